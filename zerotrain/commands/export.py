"""`zerotrain export`: not built yet (see the open issues)."""
import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    raise ValueError("'zerotrain export' is not available in this version yet")
