"""The command line: the `dspark` group and every command. Thin: each command parses its options
and calls the package that does the work; nothing outside this package imports it."""
