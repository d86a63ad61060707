"""refengine's pytest plugin (registered as the `pytest11` entry point `refengine`, so installing
refengine is enough): the markers, the Hypothesis profiles, the options and the fixtures the shipped
property suite needs. `pytest --pyargs refengine.suite` runs the suite from any directory.

Profiles follow Hypothesis's conventions: HYPOTHESIS_PROFILE (or `--hypothesis-profile`) selects
one; without it, the `ci` profile when the environment variable CI is set, else `dev`.
  dev       25 examples per property (the default on a workstation)
  ci        80 examples, derandomized: the same examples on every run of the same code
  thorough  1000 examples, for a release

A CI fleet shares its failures through one Redis: `--hypothesis-database redis://HOST:PORT/DB` (or
REFENGINE_HYPOTHESIS_DB=redis://HOST:PORT/DB; the option wins) loads the current profile with
`database=` a MultiplexedDatabase of the local `.hypothesis/examples` and a RedisExampleDatabase
(needs the `redis` package), so every machine replays a failure another one found before it generates
anything new. Tests that pass `database=None` keep it.
"""
from __future__ import annotations

import os
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

import pytest
from hypothesis import HealthCheck, settings

PROFILES = {"dev": {"max_examples": 25}, "ci": {"max_examples": 80, "derandomize": True},
            "thorough": {"max_examples": 1000}}
MARKERS = {
    "invariants": "continuous-batching properties (pytest -m invariants)",
    "http": "properties judged over HTTP: with --engine-url, the only invariants that run",
    "golden": "golden-file checks against the float64 reference",
    "parity": "agreement with HF transformers (needs the parity extra)",
    "slow": "long-running; excluded from the default run",
    # pytest-xdist's own marker, registered here too so the HTTP modules' mark is known without xdist
    "xdist_group(name)": "with pytest-xdist's --dist loadgroup, every test of the group runs on one worker",
}
DATABASE_OPTION = "--hypothesis-database"
DATABASE_ENV = "REFENGINE_HYPOTHESIS_DB"
DATABASE_SCHEMES = ("redis", "rediss", "unix")  # what redis.Redis.from_url connects to
SHARED_SUFFIX = "-with-shared-database"


class SharedDatabase(NamedTuple):
    url: str  # without its password
    client: object  # redis.Redis
    profile: str  # the profile it was derived from


SHARED_KEY = pytest.StashKey[SharedDatabase]()

for _name, _values in PROFILES.items():
    settings.register_profile(_name, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
                              **_values)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def default_golden() -> str:
    """The default model's conversations (data/golden/prompts/conversations.jsonl): chats under one long
    system prompt and conversations resent with their first answer, so the HTTP properties' schedules
    share prefixes a server's prefix cache takes, as production traffic does."""
    from ..data import shipped
    return str(shipped("golden", "tiny-chat-conversations.jsonl"))


def pytest_addoption(parser):
    group = parser.getgroup("refengine")
    group.addoption("--engine-url", metavar="URL",
                    help="run the HTTP invariants against this OpenAI-compatible server (default: an "
                         "in-process refengine server on 127.0.0.1 serving the embedded default model); the "
                         "in-process engine properties are skipped")
    group.addoption("--golden", metavar="FILE", default=None,
                    help="golden file the --engine-url server's model must match (default: the shipped "
                         "conversations golden file of the embedded default model)")
    group.addoption("--precision", choices=("auto", "f32", "bf16", "fp16"), default="auto",
                    help="what the --engine-url server computes in: its answers are held to refengine's "
                         "bound for that precision x 8, from the golden header or measured on --model "
                         "(validate --precision; auto: the dtype in --model's config.json, else f32)")
    group.addoption("--model", metavar="DIR", default=None,
                    help="the --engine-url server's model folder (HF format): the float64 reference measures "
                         "the margin at every divergence the server's answers do not carry (text only, no "
                         "logprobs), and gives the bound a golden file lacks (validate --model)")
    group.addoption("--baseline-url", metavar="URL", default=None,
                    help="the --engine-url server's model served another way (speculative decoding off): the "
                         "speculation property holds --engine-url's answers to this server's alone answers "
                         "(default, without --engine-url: an in-process refengine server speculating by prompt "
                         "lookup, held to the in-process server that does not)")
    group.addoption("--update-golden", action="store_true",
                    help="regenerate the committed golden files with the float64 reference")
    group.addoption(DATABASE_OPTION, metavar="URL", default=None,
                    help=f"share Hypothesis's example database through this Redis (redis://HOST:PORT/DB; "
                         f"default ${DATABASE_ENV}): every test uses the local .hypothesis/examples plus "
                         f"the Redis, so a failure found on one machine is replayed first on every other "
                         f"(needs the redis package)")


def redacted(url: str) -> str:
    """The URL without its password (it goes into error messages and the report header)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return url


def shared_database(url: str, source: str):
    """MultiplexedDatabase(local .hypothesis/examples, RedisExampleDatabase(url)), after checking the
    Redis answers; a bad URL or an unreachable Redis is a pytest.UsageError naming `source`."""
    from hypothesis.configuration import storage_directory
    from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase

    shown = f"{source} {redacted(url)}"
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in DATABASE_SCHEMES:
        raise pytest.UsageError(f"{shown}: unknown URL scheme {scheme or '(none)'!r}; expected "
                                f"redis://HOST:PORT/DB (or rediss://, unix://)")
    try:
        from hypothesis.extra.redis import RedisExampleDatabase
        from redis import Redis
        from redis.exceptions import RedisError
    except ImportError as e:
        raise pytest.UsageError(f"{shown}: needs the redis package ({e}); pip install 'refengine[redis]' "
                                f"or 'hypothesis[redis]'") from None
    try:
        client = Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        client.ping()
    except (RedisError, OSError, ValueError) as e:
        raise pytest.UsageError(f"{shown}: cannot reach Redis: {e}") from None
    try:  # Hypothesis's usual local database: .hypothesis/examples (or $HYPOTHESIS_STORAGE_DIRECTORY)
        home = storage_directory("examples", intent_to_write=False)  # nothing is written before a save
    except TypeError:  # older Hypothesis: no intent_to_write, a plain Path
        home = storage_directory("examples")
    local = DirectoryBasedExampleDatabase(getattr(home, "path", home))
    return client, MultiplexedDatabase(local, RedisExampleDatabase(client))


@pytest.hookimpl(trylast=True)  # after Hypothesis's own plugin has loaded --hypothesis-profile
def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    url = config.getoption(DATABASE_OPTION)
    source = DATABASE_OPTION
    if url is None and os.environ.get(DATABASE_ENV):
        url, source = os.environ[DATABASE_ENV], f"{DATABASE_ENV} ({DATABASE_OPTION})"
    if url is None:
        return
    client, database = shared_database(url, source)
    current = getattr(settings, "get_current_profile_name", lambda: "current")()
    derived = current.removesuffix(SHARED_SUFFIX) + SHARED_SUFFIX
    settings.register_profile(derived, settings.default, database=database)  # the current profile + database
    settings.load_profile(derived)
    config.stash[SHARED_KEY] = SharedDatabase(redacted(url), client, current)


def pytest_report_header(config):
    shared = config.stash.get(SHARED_KEY, None)
    if shared:
        return f"hypothesis database: .hypothesis/examples + {shared.url}"


def pytest_unconfigure(config):
    shared = config.stash.get(SHARED_KEY, None)
    if shared:
        settings.load_profile(shared.profile)  # an in-process run (pytester) gives its profile back
        shared.client.close()


def pytest_collection_finish(session):
    """Import every refengine module before the first test runs (a second or two). Hypothesis mixes the
    constants of the loaded local (non-site-packages, non-test) modules into its draws and re-reads them
    as modules load, so a derandomized test (test_coverage, the repository's fault hunts) drew other
    examples depending on which modules the tests before it had happened to import; with all of them
    loaded first it draws the same ones in any order and on any xdist worker."""
    if not session.items:
        return
    import importlib
    import pkgutil

    from .. import __path__ as package_path
    for info in pkgutil.walk_packages(package_path, "refengine."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf == "__main__" or leaf.startswith("test_"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra this environment lacks: the same in every run here
            pass


def pytest_collection_modifyitems(config, items):
    url = config.getoption("--engine-url")
    if not url:
        return
    skip = pytest.mark.skip(reason=f"--engine-url {url}: this property runs the in-process engine; only the "
                                   f"HTTP properties judge a server")
    for item in items:
        if item.get_closest_marker("invariants") and not item.get_closest_marker("http"):
            item.add_marker(skip)


HTTP_MAX_WAITING = 2  # + 4 seats = strategies.http_schedules.MAX_HTTP_REQUESTS admission slots
HTTP_QUEUE_TIMEOUT_S = 3.0


class HttpTarget(NamedTuple):
    url: str
    golden: object          # check.golden.Golden
    precision: str          # --precision: auto | f32 | bf16 | fp16
    model: object = None    # --model, loaded (refengine.model.Model); None: not given


@pytest.fixture(scope="session")
def http_engine(request):
    """HttpTarget for the HTTP invariants: the --engine-url server, the --golden file, --precision and
    the --model folder, or an in-process OpenAIServer on 127.0.0.1 serving the embedded default model,
    tiny-chat (4 seats, 32-token steps so prefill chunks mix with decodes and requests queue; prefix
    caching on, on 8-token blocks so the golden cases' short prompts fill some, and a 1,024-token pool,
    so the cold/warm/evicted property's pressure takes four prompts; HTTP_MAX_WAITING waiting slots, so its 6
    admission slots are exactly a largest schedule's requests: a leaked slot turns into a refused
    request, verdict "error", within HTTP_QUEUE_TIMEOUT_S, in one run)."""
    from ..check.golden import read_golden
    from ..engine import EngineConfig
    from ..errors import RefengineError
    from ..model import load_model
    from ..model.cache import default_model_dir
    from ..serve import OpenAIServer
    from ..validate.board import served_model
    from ..validate.client import Endpoint

    url, local = request.config.getoption("--engine-url"), request.config.getoption("--model")
    try:
        model = (load_model(local) if local else None) if url else load_model(default_model_dir())
        golden = read_golden(request.config.getoption("--golden") or default_golden())
        if url:
            served_model(Endpoint(url, timeout=10))
        else:
            golden.require_model(model)
        problem = None
    except RefengineError as e:
        problem = f"HTTP invariants: {e}"
    if problem:
        pytest.fail(problem, pytrace=False)
    if url:
        yield HttpTarget(url, golden, request.config.getoption("--precision"), model)
        return
    server = OpenAIServer(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_blocks=128,
                                              enable_prefix_caching=True),
                          host="127.0.0.1", max_waiting=HTTP_MAX_WAITING, queue_timeout=HTTP_QUEUE_TIMEOUT_S)
    server.start()
    yield HttpTarget(server.url, golden, "f32", model)  # its float64 margins: for answers with logits processors
    server.close()


HTTP_SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="session")
def http_speculation(request, http_engine):
    """(the speculating HttpTarget, the URL of the same model served without speculation) for the
    speculation property: --engine-url and --baseline-url, or in process a second server with
    http_engine's settings speculating HTTP_SPECULATIVE_TOKENS tokens by prompt lookup, held to
    http_engine's. None with --engine-url and no --baseline-url."""
    from ..engine import EngineConfig
    from ..serve import OpenAIServer

    if request.config.getoption("--engine-url"):
        baseline = request.config.getoption("--baseline-url")
        yield None if baseline is None else (http_engine, baseline)
        return
    server = OpenAIServer(http_engine.model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
                                                          num_blocks=128, enable_prefix_caching=True,
                                                          num_speculative_tokens=HTTP_SPECULATIVE_TOKENS),
                          host="127.0.0.1", max_waiting=HTTP_MAX_WAITING, queue_timeout=HTTP_QUEUE_TIMEOUT_S)
    server.start()
    yield http_engine._replace(url=server.url), http_engine.url
    server.close()
