"""``--trainer-config``: the warmup knobs from verl's Hydra config, and where /api/v1/status says they came from."""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from tests.conftest import sample_value
from tqmon.cli import main
from tqmon.hydra_config import HydraConfigError, load_trainer_config

# The shape of a composed verl 0.9.1 config, with the interpolations Hydra leaves unresolved.
HYDRA = """
data:
  train_batch_size: ${oc.env:TQMON_TEST_BATCH,16}
  gen_batch_size: null
algorithm:
  filter_groups:
    enable: false
    metric: null
skip:
  rollout_tq:
    enable: false
trainer:
  project_name: gsm8k_dapo
  experiment_name: ${oc.env:TQMON_TEST_EXPERIMENT,qwen_run7}
  default_local_dir: checkpoints/demo
  v1:
    trainer_mode: separate_async
    sync: {}
    colocate_async:
      num_warmup_batches: 1
    separate_async:
      num_warmup_batches: 2.5
      max_lag: 4
    sampler:
      max_off_policy_threshold: ${trainer.v1.separate_async.max_lag}
      max_off_policy_strategy: drop
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / ".hydra" / "config.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_reads_the_knobs_and_resolves_interpolations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQMON_TEST_BATCH", "12")
    path = write(tmp_path, HYDRA)
    given = load_trainer_config(path)
    mode, config = given.trainer_mode, given.config
    assert mode == "separate_async"
    assert config.train_batch_size == 12  # from the environment, as the trainer saw it
    assert config.num_warmup_batches == 2.5  # the mode's own knob, not colocate_async's
    assert config.max_off_policy_threshold == 4
    assert (config.gen_batch_size, config.skip_rollout_tq, config.filter_groups) == (None, False, False)
    assert config.filter_groups_metric is None


def test_reads_dapos_metric(tmp_path: Path) -> None:
    metric = "    enable: true\n    metric: ${oc.env:TQMON_NO_SUCH,acc}"  # interpolated, as Hydra saves it
    dapo = HYDRA.replace("    enable: false\n    metric: null", metric)
    config = load_trainer_config(write(tmp_path, dapo)).config
    assert (config.filter_groups, config.filter_groups_metric, config.dapo_metric) == (True, "acc", "acc")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("trainer_mode: separate_async", "trainer_mode: turbo"), "trainer.v1.trainer_mode is 'turbo'"),
        (("  train_batch_size: ${oc.env:TQMON_TEST_BATCH,16}\n", ""), "data.train_batch_size is missing"),
        (("      num_warmup_batches: 2.5", "      num_warmup_batches: lots"), "num_warmup_batches"),
        (("data:", "data: ["), "invalid YAML"),
        (("max_off_policy_strategy: drop", "max_off_policy_strategy: keep"), "max_off_policy_strategy"),
    ],
)
def test_a_config_that_cannot_work_is_named(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    path = write(tmp_path, HYDRA.replace(*edit))
    with pytest.raises(HydraConfigError) as err:
        load_trainer_config(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_unresolvable_interpolation_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, HYDRA.replace("      max_lag: 4\n", ""))
    with pytest.raises(HydraConfigError, match=r"cannot resolve trainer.v1.sampler.max_off_policy_threshold"):
        load_trainer_config(path)


def test_file_and_flags_together_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, HYDRA)
    result = CliRunner().invoke(
        main, ["serve", "--trainer-config", str(path), "--train-batch-size", "8", "--state-dir", str(tmp_path / "s")]
    )
    assert result.exit_code == 2
    assert "give either --trainer-config or --train-batch-size/--num-warmup-batches" in result.output


def test_serve_uses_the_file_and_says_so(tmp_path: Path, tqmon_factory) -> None:
    path = write(tmp_path, HYDRA)
    proc = tqmon_factory(["--trainer-config", str(path)]).start()
    # T = floor(2.5 * 16 / 1) * 1 = 40 (separate_async forces gen_batch_size 1)
    assert sample_value(proc.metrics(), "tqmon_window_target_prompt_groups") == 40
    run = httpx.get(proc.url + "/api/v1/status").json()["run"]
    assert run["config_source"] == f"file:{path}"
    assert run["trainer_mode"] == "separate_async"
    assert run["config"]["num_warmup_batches"] == 2.5
    # The run's identity: verl's project and experiment names, so the fleet dashboard's run variable is set.
    assert run["run_id"] == "gsm8k_dapo/qwen_run7"
    info = 'tqmon_run_info{run_id="gsm8k_dapo/qwen_run7",trainer_mode="separate_async",verl_version=""}'
    assert sample_value(proc.metrics(), info) == 1
