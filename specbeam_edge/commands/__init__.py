"""The `specbeam` command line (cli.py) and the flags its commands and the apps share (flags.py)."""
