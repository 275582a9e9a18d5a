"""The warmup knobs from verl's own Hydra config file (``<run dir>/.hydra/config.yaml``).

Hydra saves the composed config with interpolations unresolved; OmegaConf resolves the few keys read
here, so ``train_batch_size: ${oc.env:BATCH}`` works as it did for the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tqmon.events import TrainerConfig, describe_validation
from tqmon.warmup import TRAINER_MODES

_MISSING = object()


class HydraConfigError(ValueError):
    """The file cannot give a trainer config; the message names the file and the key."""


def load_trainer_config(path: Path) -> tuple[str, TrainerConfig]:
    """``(trainer_mode, config)`` from a resolved or unresolved verl config file."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.load(path)
    except OSError as err:
        raise HydraConfigError(f"{path}: {err.strerror or err}") from None
    except Exception as err:  # yaml.YAMLError and OmegaConf's own errors on a malformed file
        raise HydraConfigError(f"{path}: not a YAML mapping: {err}") from None

    def get(key: str, default: Any = _MISSING) -> Any:
        try:
            value = OmegaConf.select(cfg, key, default=_MISSING, throw_on_resolution_failure=True)
        except OmegaConfBaseException as err:
            raise HydraConfigError(f"{path}: cannot resolve {key}: {err}") from None
        if value is _MISSING:
            if default is _MISSING:
                raise HydraConfigError(f"{path}: {key} is missing (is this verl's .hydra/config.yaml?)")
            return default
        return value

    mode = get("trainer.v1.trainer_mode")
    if mode not in TRAINER_MODES:
        raise HydraConfigError(f"{path}: trainer.v1.trainer_mode is {mode!r}, not one of {sorted(TRAINER_MODES)}")
    filter_groups = get("algorithm.filter_groups", None)
    try:
        config = TrainerConfig(
            train_batch_size=get("data.train_batch_size"),
            gen_batch_size=get("data.gen_batch_size", None),
            num_warmup_batches=0 if mode == "sync" else get(f"trainer.v1.{mode}.num_warmup_batches"),
            skip_rollout_tq=get("skip.rollout_tq.enable", False),
            max_off_policy_threshold=get("trainer.v1.sampler.max_off_policy_threshold", 8),
            max_off_policy_strategy=get("trainer.v1.sampler.max_off_policy_strategy", "drop"),
            filter_groups=bool(filter_groups is not None and get("algorithm.filter_groups.enable", False)),
            filter_groups_metric=None if filter_groups is None else get("algorithm.filter_groups.metric", None),
        )
    except ValidationError as err:
        raise HydraConfigError(f"{path}: {describe_validation(err)}") from None
    return str(mode), config
