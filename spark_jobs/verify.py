"""spark-submit entry point: one audit of a pipeline's tables (the same as `oncemore verify`).

    spark-submit --py-files oncemore.zip spark_jobs/verify.py --config include/pipelines/examples/orders.yaml \
        [--since VERSION] [--json] [--record]

Exits 1 on a discrepancy. The master and Spark settings come from spark-submit; the package
travels in --py-files.
"""

import sys

from oncemore.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
