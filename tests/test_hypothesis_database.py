"""`--hypothesis-database redis://...` (suite.plugin) against a real redis-server on 127.0.0.1: a failure
one pytest process finds is the first example another process — in another directory, sharing no
local database, only the Redis — runs. Asserted on the examples the test itself recorded, never on
Hypothesis's messages. Bad URLs and an unreachable Redis are usage errors naming the option."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None,
                                reason="redis-server is not installed (apt-get install -y redis-server)")
redis = pytest.importorskip("redis", reason="the redis package is not installed (pip install 'hypothesis[redis]')")

USAGE_ERROR = 4  # pytest.ExitCode.USAGE_ERROR
TESTS_FAILED = 1
FLEET_TEST = '''\
import os

from hypothesis import given, settings, strategies as st


def record(name, x):
    with open(os.path.join(os.environ["SEEN_DIR"], name), "a") as f:
        f.write(f"{x}\\n")


@settings(derandomize=False)
@given(st.integers())
def test_shared(x):
    record("shared", x)
    assert x < 1000


@settings(derandomize=False, database=None)
@given(st.integers())
def test_without_database(x):
    record("without_database", x)
    assert x < 1000
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A throwaway redis-server on 127.0.0.1 (no persistence); its URL, database 3."""
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    with open(workdir / "redis.log", "wb") as log:
        server = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(workdir)],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, db=3, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server on port {port} did not start:\n"
                                f"{(workdir / 'redis.log').read_text(errors='replace')}")
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/3"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run_pytest(directory, *args, env=None):
    """`python -m pytest` on the fleet test file in `directory` (its own rootdir, its own
    .hypothesis), with the refengine plugin from its entry point and the dev profile."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pytest.ini").write_text("[pytest]\n")  # rootdir here: no ini file of an enclosing folder
    (directory / "test_fleet.py").write_text(FLEET_TEST)
    (directory / "seen").mkdir(exist_ok=True)
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("PYTEST_", "HYPOTHESIS_", "REFENGINE_HYPOTHESIS_DB"))}
    full_env.update(HYPOTHESIS_PROFILE="dev", SEEN_DIR=str(directory / "seen"), **(env or {}))
    unneeded = ["-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:xdist", "-p", "no:anyio"]  # startup time
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *unneeded, "test_fleet.py", *args], cwd=directory,
                          env=full_env, capture_output=True, text=True, timeout=300)


def seen(directory, name) -> list[int]:
    path = directory / "seen" / name
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_a_failure_found_on_one_machine_is_the_first_example_on_another(tmp_path, redis_url):
    first, second = tmp_path / "machine-1", tmp_path / "machine-2"
    one = run_pytest(first, "--hypothesis-database", redis_url)  # the option ...
    assert one.returncode == TESTS_FAILED, one.stdout + one.stderr
    found = seen(first, "shared")
    shrunk = found[-1]  # Hypothesis runs the shrunk failing example last
    assert shrunk >= 1000 and shrunk == min(x for x in found if x >= 1000), found
    assert found[0] != shrunk, found  # it had to be searched for: the Redis was empty
    assert (first / ".hypothesis" / "examples").is_dir()  # the local database is written too
    assert not (second / ".hypothesis").exists()

    two = run_pytest(second, env={"REFENGINE_HYPOTHESIS_DB": redis_url})  # ... or the environment
    assert two.returncode == TESTS_FAILED, two.stdout + two.stderr
    replayed = seen(second, "shared")
    assert replayed[0] == shrunk, (replayed[:5], shrunk)

    # an explicit database=None keeps it: nothing was shared, machine 2 searched afresh
    without = seen(first, "without_database")
    assert seen(second, "without_database")[0] != without[-1], (seen(second, "without_database")[:5], without[-1])


@pytest.mark.parametrize("case", ["unknown scheme", "unreachable"])
def test_a_bad_database_url_is_a_usage_error_naming_the_option(tmp_path, case):
    if case == "unknown scheme":
        result = run_pytest(tmp_path, env={"REFENGINE_HYPOTHESIS_DB": "memcached://127.0.0.1:11211/0"})
        expected = ["REFENGINE_HYPOTHESIS_DB (--hypothesis-database) memcached://", "unknown URL scheme"]
    else:  # nothing listens on that port; the option wins over the (bad) environment variable
        dead = f"redis://127.0.0.1:{free_port()}/0"
        result = run_pytest(tmp_path, "--hypothesis-database", dead, env={"REFENGINE_HYPOTHESIS_DB": "nonsense"})
        expected = [f"--hypothesis-database {dead}: cannot reach Redis"]
    output = result.stdout + result.stderr
    assert result.returncode == USAGE_ERROR, output
    assert all(text in result.stderr for text in expected), output
    assert "Traceback" not in output, output
    assert not seen(tmp_path, "shared")  # no test ran
