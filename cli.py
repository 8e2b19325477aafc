#!/usr/bin/env python3
"""Run the dflash command line from a checkout: `python cli.py prefill ...` equals `dflash prefill ...`."""
from dflash.__main__ import main

if __name__ == "__main__":
    main()
