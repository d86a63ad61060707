"""A golden refresh on a Ray cluster (check.golden_ray) writes the file a refresh on one machine writes,
byte for byte: here on a local cluster of two workers, each lockstep group a task. Skipped without the
ray extra."""
from __future__ import annotations

import pytest

from refengine.check.golden import load_prompts, refresh
from refengine.check.golden_ray import refresh_group
from refengine.cli import main
from refengine.data import shipped
from refengine.errors import RefengineError
from refengine.model import load_model
from refengine.model.cache import default_model_dir

ray = pytest.importorskip("ray")
PROMPTS = shipped("golden", "prompts", "seed-experiment.jsonl")
NOISE = {"f32_vs_f64": 1e-5, "safety_factor": 4.0}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TQDM_DISABLE": "1"}})
    yield
    ray.shutdown()


def test_a_refresh_on_a_two_worker_cluster_writes_the_one_machine_bytes(cluster, tmp_path):
    from refengine.check.golden_ray import refresh_on_ray

    model, prompts = load_model(default_model_dir()), load_prompts(PROMPTS)
    here = refresh(model, PROMPTS, prompts, tmp_path / "here.jsonl", NOISE, group=4)
    there = refresh_on_ray(model, PROMPTS, prompts, tmp_path / "ray.jsonl", NOISE, group=4)
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "here.jsonl").read_bytes()
    assert [c.id for c in there.cases] == [p.id for p in prompts] and len(prompts) > 8  # three groups of 4
    assert ray.is_initialized()  # a cluster it joined is left running


def test_a_worker_with_another_blas_refuses_to_answer():
    prompts = load_prompts(PROMPTS)[:1]
    with pytest.raises(RefengineError, match="BLAS"):
        refresh_group(str(default_model_dir()), prompts, {"internal_api": "another", "name": None})


def test_ray_with_a_shard_is_refused_naming_the_flag(tmp_path, capsys):
    assert main(["golden", "refresh", "--prompts", str(PROMPTS), "--out", str(tmp_path / "g.jsonl"),
                 "--calibration", str(tmp_path / "none.json"), "--ray", "--shard", "1/2"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--ray" in err
