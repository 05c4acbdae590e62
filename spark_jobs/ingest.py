"""spark-submit entry point: one oncemore run (the same as `oncemore run`).

    spark-submit --py-files oncemore.zip spark_jobs/ingest.py --config include/pipelines/examples/orders.yaml \
        [--plan-file plan.json] [--until ...] [--run-id ...]

The master and Spark settings come from spark-submit; the package travels in --py-files.
"""

import sys

from oncemore.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
