"""`python -m perf.device_check ...`: the command line of the check (`main` and its flags are in
__init__.py)."""
from perf.device_check import main

if __name__ == "__main__":
    # argparse would name the program after this file (__main__.py); the usage line keeps the name it had
    # when the check was the one file perf/device_check.py
    main(prog="device_check.py")
