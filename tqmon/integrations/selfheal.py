"""The plugin's opt-in self-heal: after verl's warmup of a resumed start, submit the groups the window lacks.

verl 0.9.1 submits ``max(0, T - R)`` warmup groups, but R counts groups the first sample evicts, so the
window starts ``doomed`` short of T. In ``on`` mode the plugin submits exactly the deficit tqmon derives
(:func:`tqmon.warmup.plan_top_up`, from the doomed groups :func:`tqmon.warmup.known_doomed` decides over the
restored groups the plugin reported in ``checkpoint_restored``, DAPO's verdicts included), through a
``submit`` the verl glue hands it (verl's own ``_add_prompts_to_generate``).
``dry-run`` records what it would submit. Every decision is one ``self_heal_decided`` event.

Configured by a Hydra override on verl's command line (``+tqmon.self_heal=on``,
``+tqmon.self_heal_max_top_up=N``) or, where the override is absent, ``$TQMON_SELF_HEAL`` and
``$TQMON_SELF_HEAL_MAX_TOP_UP``. Off by default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from tqmon.events import PLUGIN_REASON_LENGTH, GroupCount, SelfHealDecided, restored_groups, status_counts
from tqmon.integrations.logs import RateLimitedLog
from tqmon.integrations.resume import Sink
from tqmon.warmup import (
    DOOM_REASONS,
    SELF_HEAL_MODES,
    SelfHealMode,
    WarmupConfig,
    known_doomed,
    plan_top_up,
    target_window,
)

log = logging.getLogger("tqmon.integrations")

MODE_ENV = "TQMON_SELF_HEAL"
CAP_ENV = "TQMON_SELF_HEAL_MAX_TOP_UP"
SECTION = "tqmon"  # the Hydra section the plugin reads: +tqmon.self_heal=on, +tqmon.self_heal_max_top_up=N


def _setting(config: Any, key: str, env: str) -> str:
    """The override's value, else the environment's, as text ('' when neither gives one)."""
    section = config.get(SECTION) if hasattr(config, "get") else None
    value = section.get(key) if section is not None else None
    return str(value if value is not None else os.environ.get(env, "")).strip()


def self_heal_settings(config: Any) -> tuple[SelfHealMode, int | None]:
    """The mode and ``max_top_up`` (None: T) from verl's config or the environment; a value that is not one
    of the modes (or not an integer >= 0) is refused with one line and means ``off`` (no cap: T)."""
    raw = _setting(config, "self_heal", MODE_ENV).lower() or "off"
    if raw not in SELF_HEAL_MODES:
        log.warning("tqmon: self-heal mode %r is not one of %s; the self-heal is off", raw, "|".join(SELF_HEAL_MODES))
        return "off", None
    mode: SelfHealMode = raw
    cap_raw = _setting(config, "self_heal_max_top_up", CAP_ENV)
    if not cap_raw:
        return mode, None
    try:
        cap = int(cap_raw)
    except ValueError:
        cap = -1
    if cap < 0:
        log.warning("tqmon: self-heal max_top_up %r is not an integer >= 0; the self-heal is off", cap_raw)
        return "off", None
    return mode, cap


def decide(
    sink: Sink,
    event_id: str,
    mode: SelfHealMode,
    cap: int | None,
    config: WarmupConfig,
    groups: list[GroupCount],
    checkpoint_step: int,
    warmup: int,
    submit: Callable[[int], object],
    measured: Callable[[], int],
    failures: RateLimitedLog,
) -> SelfHealDecided:
    """Decide the top-up for a resume from ``global_step_{checkpoint_step}`` whose warmup submitted ``warmup``
    (M), submit it in ``on`` mode and report the decision with what was submitted, as ``measured`` counts it
    (the groups that reached ``generate_sequences``). A failing ``submit`` is logged (rate-limited, counted in
    ``failures``) and reported; it never raises: verl goes on as without the top-up."""
    restored = sum(group.count for group in groups)
    doomed: Mapping[str, int] = (
        known_doomed(config, status_counts(None, groups), restored_groups(groups), checkpoint_step) or {}
    )
    target = target_window(config)
    limit = target if cap is None else cap
    plan = plan_top_up(config, restored, doomed, warmup, limit)
    verb = "submitted" if mode == "on" else "would submit"
    reason = f"{verb} {plan.planned}: {plan.reason}"
    if mode == "on" and plan.planned:
        try:
            submit(plan.planned)
        except Exception as err:
            reason = f"failed submitting {plan.planned}: {type(err).__name__}: {err}; {plan.reason}"
            failures.warning(f"tqmon: the self-heal {reason}; verl goes on without it", exc_info=err)
    event = SelfHealDecided(
        id=event_id,
        mode=mode,
        target_prompt_groups=target,
        restored_prompt_groups=restored,
        doomed_prompt_groups={k: v for k, v in doomed.items() if k in DOOM_REASONS},
        warmup_prompt_groups=warmup,
        deficit_prompt_groups=plan.deficit,
        deficit_exact=plan.exact,
        max_top_up=limit,
        planned_prompt_groups=plan.planned,
        submitted_prompt_groups=measured(),
        reason=reason[:PLUGIN_REASON_LENGTH],
    )
    log.info("tqmon: self-heal (%s): %s", mode, event.reason)
    sink.post(event)
    return event
