"""Rows a decoder built in Python (dicts, or bare values for a one-column table) to an Arrow table.

Invariant: a row Arrow refuses for the table's schema is held out (a null row) with the reason in
``errors``, never dropped or coerced; the whole batch converts at once when every row fits.
"""

from __future__ import annotations

import pyarrow as pa

_REFUSALS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)


def rows_to_table(rows: list, schema: pa.Schema, errors: dict[int, str], *, single_column: bool = False) -> pa.Table:
    """``rows[i]`` is a dict of the columns (or, with ``single_column``, the one column's value),
    or None for a null row. Adds the index and reason of each row Arrow refuses to ``errors``."""
    kind = schema.field(0).type if single_column else pa.struct(list(schema))
    try:
        array = pa.array(rows, kind)
    except _REFUSALS:
        # Rare: find the rows Arrow refuses one by one, and hold them out.
        for index, row in enumerate(rows):
            try:
                pa.array([row], kind)
            except _REFUSALS as exc:
                errors[index], rows[index] = f"value does not fit the table's schema: {exc}", None
        array = pa.array(rows, kind)
    if single_column:
        return pa.Table.from_arrays([array], schema=schema)
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(array)], schema)
