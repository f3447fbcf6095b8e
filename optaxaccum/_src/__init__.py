"""Private implementation of optaxaccum; import from ``optaxaccum`` instead."""
