"""A golden refresh on a Ray cluster: each lockstep group of the prompt set is a Ray task, the groups' answers
come back in prompt order, and the file written is the one a refresh on one machine writes, byte for byte.

That holds because a case's answer depends only on its lockstep group (check.golden: groups are fixed
runs of the prompt file, decoded together) and on the BLAS build: each worker loads the model from the
same path (a shared filesystem on a multi-node cluster), refuses to run where its BLAS is not the
driver's (another build gives other last bits, and the header records the driver's), and decodes its
group as the one-machine refresh does. The driver calibrates (or reads the stored calibration) and writes
the header, as the one-machine refresh; it shows progress in tokens as groups finish.

`ray` is an optional extra (pip install 'refengine[ray]'): nothing else imports this module.
"""
from __future__ import annotations

import socket
from pathlib import Path

from tqdm import tqdm

from ..blas import blas_numerics
from ..errors import RefengineError
from ..model import Model, load_model
from .golden import LOCKSTEP_GROUP, Golden, PromptCase, golden_header, lockstep_groups, reference_cases, write_golden

# The workers' own progress bars would interleave in the driver's log: the driver shows the whole.
WORKER_ENV = {"TQDM_DISABLE": "1"}


def refresh_group(model_path: str, cases: list[PromptCase], numerics: dict) -> list:
    """One lockstep group's golden cases, on a Ray worker: RefengineError where the worker's BLAS is not
    the driver's (`numerics`)."""
    here = blas_numerics()
    if here != numerics:
        raise RefengineError(f"ray worker on {socket.gethostname()}: its BLAS {here} is not the driver's {numerics}: "
                             f"its float64 answers would differ in the last bits from the header's")
    return reference_cases(load_model(model_path), cases, desc="golden group", group=len(cases))


def _ray():
    try:
        import ray
    except ImportError:
        raise RefengineError("ray: the Ray refresh needs the ray extra (pip install 'refengine[ray]')") from None
    return ray


def refresh_on_ray(model: Model, prompts_path: str | Path, prompts: list[PromptCase], out: str | Path, noise: dict,
                   group: int = LOCKSTEP_GROUP, address: str | None = None) -> Golden:
    """check.golden.refresh with each lockstep group a Ray task on the cluster at `address` (None: Ray's
    own default, RAY_ADDRESS or else a new local cluster; "auto": the local node's running cluster), or
    on the cluster this process already joined. A cluster this call started is shut down after."""
    ray = _ray()
    out, prompts_path = Path(out), Path(prompts_path)
    groups = lockstep_groups(prompts, group)
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address or None, runtime_env={"env_vars": WORKER_ENV}, include_dashboard=False,
                     log_to_driver=False)
        except ConnectionError as e:
            raise RefengineError(f"ray: cannot reach the cluster at {address!r} ({e})") from None
    try:
        task = ray.remote(refresh_group)
        pending = {task.remote(str(model.path), cases, blas_numerics()): n for n, cases in enumerate(groups)}
        answers: dict[int, list] = {}
        with tqdm(total=sum(case.max_tokens for case in prompts), desc=f"golden {out.name} on ray",
                  unit="tok") as bar:
            while pending:
                [done], _ = ray.wait(list(pending), num_returns=1)
                n = pending.pop(done)
                try:
                    answers[n] = ray.get(done)
                except RefengineError as e:  # a worker's refusal, as Ray re-raises it
                    raise RefengineError(str(getattr(e, "cause", None) or e)) from None
                bar.update(sum(case.max_tokens for case in groups[n]))
    finally:
        if started:
            ray.shutdown()
    cases = [case for n in range(len(groups)) for case in answers[n]]
    header = golden_header(model, prompts_path, noise, group)
    write_golden(out, header, cases)
    return Golden(out, header, cases)
