"""What every OpenAI-client check of `toy serve` starts with.

Each script runs as `SCRIPT BASE_URL API_KEY [ARGS…]`: `connect()` reads the first two arguments
and returns the official client pointed at the server; `check()` raises with the reason, which the
Rust test shows when the script exits 1.
"""

import sys

from openai import OpenAI


def connect(timeout=300):
    """(client, base URL, API key, the remaining command-line arguments)."""
    base, key = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=timeout)
    return client, base, key, sys.argv[3:]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
