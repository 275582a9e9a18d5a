"""The warmup knobs from verl's own Hydra config file (``<run dir>/.hydra/config.yaml``).

Hydra saves the composed config with interpolations unresolved; OmegaConf resolves the few keys read
here, so ``train_batch_size: ${oc.env:BATCH}`` works as it did for the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tqmon.events import describe_validation
from tqmon.warmup import TRAINER_MODES, GivenConfig, TrainerConfig, verl_setting

_MISSING = object()
RUN_NAME_KEYS = ("trainer.project_name", "trainer.experiment_name")  # the run's identity, as verl names its dirs


class HydraConfigError(ValueError):
    """The file cannot give a trainer config; the message names the file and the key."""


def _load(path: Path) -> Any:
    """The file as an OmegaConf config; a malformed one is one line naming the file and the line."""
    import yaml
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(path)
    except OSError as err:
        raise HydraConfigError(f"{path}: {err.strerror or err}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = "" if mark is None else f" line {mark.line + 1}, column {mark.column + 1}:"
        raise HydraConfigError(f"{path}:{where} invalid YAML: {err.problem or err.context}") from None
    except Exception as err:  # other yaml.YAMLError and OmegaConf's own errors on a malformed file
        raise HydraConfigError(f"{path}: not a YAML mapping: {' '.join(str(err).split())}") from None


def read_setting(path: Path, key: str) -> Any:
    """One key of the config (interpolations resolved), or None when it is absent or cannot be resolved."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.select(_load(path), key, default=None)
    except OmegaConfBaseException:
        return None


def load_trainer_config(path: Path) -> GivenConfig:
    """The trainer mode and config from a resolved or unresolved verl config file."""
    cfg = _load(path)
    mode, config = trainer_settings(cfg, str(path))
    names = [_select(cfg, key, str(path), None) for key in RUN_NAME_KEYS]
    run_id = "/".join(str(name) for name in names if name not in (None, ""))
    return GivenConfig(mode, config, f"file:{path}", run_id)


def trainer_settings(cfg: Any, origin: str) -> tuple[str, TrainerConfig]:
    """The trainer mode and each :class:`TrainerConfig` setting at its declared verl path, from a loaded
    OmegaConf config: Hydra's saved file here, the trainer's live config in the verl plugin. ``origin``
    names it in errors."""
    mode = _select(cfg, "trainer.v1.trainer_mode", origin)
    if mode not in TRAINER_MODES:
        raise HydraConfigError(f"{origin}: trainer.v1.trainer_mode is {mode!r}, not one of {sorted(TRAINER_MODES)}")
    values: dict[str, Any] = {}
    for name, spec in TrainerConfig.model_fields.items():
        key = verl_setting(name).path
        if "<mode>" in key and mode == "sync":
            values[name] = 0  # verl has no trainer.v1.sync section: sync mode has no warmup
            continue
        default = _MISSING if spec.is_required() else spec.default
        value = _select(cfg, key.replace("<mode>", str(mode)), origin, default)
        values[name] = default if value is None and spec.annotation is bool else value  # an absent section
    try:
        return str(mode), TrainerConfig(**values)
    except ValidationError as err:
        raise HydraConfigError(f"{origin}: {describe_validation(err)}") from None


def _select(cfg: Any, key: str, origin: str, default: Any = _MISSING) -> Any:
    """One key, interpolations resolved; ``default`` when absent, an error naming the key when required."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        value = OmegaConf.select(cfg, key, default=_MISSING, throw_on_resolution_failure=True)
    except OmegaConfBaseException as err:
        raise HydraConfigError(f"{origin}: cannot resolve {key}: {err}") from None
    if value is _MISSING:
        if default is _MISSING:
            raise HydraConfigError(f"{origin}: {key} is missing (is this verl's .hydra/config.yaml?)")
        return default
    return value
