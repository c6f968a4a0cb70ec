"""Functions the tests share (fixtures live in conftest.py): `files` compares and probes directories,
`cli` runs the console entry point, `encodings` compares INT4 encodings."""
