"""The Parquet files a task writes: which columns are dictionary-encoded (writer.dictionary_columns)."""

import pyarrow as pa
import pyarrow.parquet as pq

from oncemore.write.files import DICTIONARY_SAMPLE_ROWS, TableWriter


def dictionary_encoded(path: str) -> dict[str, bool]:
    """Per Parquet column of the file's first row group, whether its values are dictionary-encoded."""
    group = pq.ParquetFile(path).metadata.row_group(0)
    return {group.column(i).path_in_schema: any("DICTIONARY" in e for e in group.column(i).encodings)
            for i in range(group.num_columns)}


def test_a_file_dictionary_encodes_the_columns_whose_values_repeat_and_every_nested_leaf(tmp_path):
    n = 3 * DICTIONARY_SAMPLE_ROWS
    table = pa.table({
        "_kafka_offset": pa.array(range(n), pa.int64()),  # all distinct
        "_kafka_partition": pa.array([0] * n, pa.int32()),
        # Of the first DICTIONARY_SAMPLE_ROWS: 9 in 10 distinct, and just under.
        "amount": pa.array([i % (DICTIONARY_SAMPLE_ROWS * 9 // 10) / 4 for i in range(n)]),
        "customer": pa.array([f"customer-{i % (DICTIONARY_SAMPLE_ROWS * 9 // 10 - 1)}" for i in range(n)]),
        "_kafka_topic": pa.array(["orders"] * n),
        "maybe": pa.array([None] * n, pa.string()),
        "address": pa.array([{"city": "Oslo", "zip": str(i)} for i in range(n)],
                            pa.struct([("city", pa.string()), ("zip", pa.string())])),
        "lines": pa.array([[{"sku": f"s{i}"}] for i in range(n)], pa.list_(pa.struct([("sku", pa.string())]))),
        "attributes": pa.array([[("k", i)] for i in range(n)], pa.map_(pa.string(), pa.int64())),
        "tags": pa.array([[i] for i in range(n)], pa.large_list(pa.int32())),
    })
    writer = TableWriter("main", str(tmp_path), table.schema)
    writer.write(table)
    [written] = writer.close()

    path = str(tmp_path / written.path)
    assert pq.read_table(path).equals(table)
    assert dictionary_encoded(path) == {
        "_kafka_offset": False, "_kafka_partition": True, "amount": False, "customer": True, "_kafka_topic": True,
        "maybe": True,
        # Nested leaves keep Arrow's default, whatever their values.
        "address.city": True, "address.zip": True, "lines.list.element.sku": True,
        "attributes.key_value.key": True, "attributes.key_value.value": True, "tags.list.element": True,
    }
