"""The metric catalog: the single source of truth for every series tqmon exposes.

Exposition, the OTLP exporter, ``docs/metrics.md`` and the tests all read this table, so a
metric cannot exist in one place and not in the others.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tqmon.judge import QUANTITIES
from tqmon.snapshot import PLUGIN_WINDOW_READERS, RegressionReason, SourceName
from tqmon.versions import VERSION_SOURCES
from tqmon.warmup import DOOM_REASONS, PARTITIONS, PROMPT_STATUSES, SELF_HEAL_MODES, SEMANTICS, WarmupState


class MetricType(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    GAUGEHISTOGRAM = "gaugehistogram"
    STATESET = "stateset"  # exposed as a 0/1 gauge per state, like kube-state-metrics' phases
    INFO = "info"


class Stability(enum.StrEnum):
    """A metric's promise, as kube-state-metrics states it: a stable name, labels and meaning change only
    with a deprecation first; an experimental one may change in any release."""

    STABLE = "stable"
    EXPERIMENTAL = "experimental"
    DEPRECATED = "deprecated"


@dataclass(frozen=True, slots=True)
class Label:
    """A label and its allowed values; ``values is None`` only for identity labels of ``_info`` metrics."""

    name: str
    values: tuple[str, ...] | None
    help: str


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    type: MetricType
    help: str
    unit: str = ""
    labels: tuple[Label, ...] = ()
    stability: Stability = Stability.STABLE

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(label.name for label in self.labels)

    @property
    def state_label(self) -> Label:
        """The label that carries the state of a stateset (always its last label)."""
        if self.type is not MetricType.STATESET:
            raise TypeError(f"{self.name} is not a stateset")
        return self.labels[-1]


SOURCES = tuple(source.value for source in SourceName)
WINDOW_STATUSES = ("ok", "under_filled", "over_filled", "unknown")
TRAINER_MODES = ("colocate_async", "separate_async", "sync", "unknown")
REJECT_REASONS = (
    "malformed_json",
    "invalid_event",
    "unknown_type",
    "too_large",
    "unauthorized",
    "too_slow",
    "state_unavailable",
)
PICKLE_REFUSAL_REASONS = ("forbidden_global", "oversized_length", "memo_index", "too_deep", "truncated", "malformed")
STATE_WRITE_FAILURE_REASONS = ("read_only", "no_space", "missing", "io_error")
SOURCE_ERROR_REASONS = ("read_error", "malformed_line", "timeout", "unavailable", "invalid_data", "too_large")
EVENT_OUTCOMES = ("applied", "duplicate")
LOG_LINE_OUTCOMES = ("event", "ignored", "malformed")
OTLP_SIGNALS = ("metrics", "logs")
AGE_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)

PARTITION = Label("partition", PARTITIONS, "TransferQueue partition: `train` or `val`.")
STATUS = Label(
    "status",
    (*PROMPT_STATUSES, "unknown"),
    "Prompt group status from its TQ tag; `unknown` where a source gives only a total.",
)
REASON = Label(
    "reason", DOOM_REASONS, "Why the first sample after a resume evicts the group (failure > stale > filtered)."
)
SOURCE = Label("source", SOURCES, "The tqmon source that observed it.")
SEMANTICS_LABEL = Label(
    "semantics",
    SEMANTICS,
    "The warmup of a verl release: `verl-0.9.1` tops the restore up to T, `verl-0.9.0` submits num_warmup_batches"
    " whole batches on top of it.",
)
_EACH_WARMUP = (
    "under the warmup of the verl release tqmon knows (tqmon_verl_version_info), or one series per semantics"
    " while it is unknown"
)
SELF_HEAL_MODE = Label(
    "mode",
    tuple(mode for mode in SELF_HEAL_MODES if mode != "off"),
    "The verl plugin's self-heal mode: `on` submits, `dry-run` only records (`off` reports nothing).",
)

_BY_STATUS = "Labelled by status; the sum over status is the total."


CATALOG: tuple[MetricSpec, ...] = (
    # Live window, from the freshest source that sees it.
    MetricSpec(
        "tqmon_window_prompt_groups",
        MetricType.GAUGE,
        f"Prompt groups in the TransferQueue prefetch window now. {_BY_STATUS}",
        "prompt_groups",
        (PARTITION, STATUS),
    ),
    MetricSpec(
        "tqmon_window_trajectories",
        MetricType.GAUGE,
        "Trajectory keys in the partition now.",
        "trajectories",
        (PARTITION,),
    ),
    MetricSpec(
        "tqmon_window_orphan_trajectories",
        MetricType.GAUGE,
        "Trajectory keys whose prompt uid has no prompt key (nothing clears them after a resume).",
        "trajectories",
        (PARTITION,),
    ),
    MetricSpec(
        "tqmon_window_target_prompt_groups",
        MetricType.GAUGE,
        "Target prefetch window T = floor(num_warmup_batches * train_batch_size / gen_batch_size) * gen_batch_size.",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_window_prompt_group_age_steps",
        MetricType.GAUGEHISTOGRAM,
        "Trainer step minus the tag global_steps of the live training prompt groups.",
        "steps",
        stability=Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_window_status",
        MetricType.STATESET,
        "Live training window against the target: ok, under_filled, over_filled or unknown.",
        "",
        (Label("status", WINDOW_STATUSES, "Window verdict."),),
    ),
    MetricSpec(
        "tqmon_plugin_window_state",
        MetricType.STATESET,
        "Who reads the live window: reporting (the verl plugin, from the replay buffer's own sync), kv_list "
        "(tqmon's TQ poll, --ray-address: the plugin is absent, off, refused a verl that differs from its pins, "
        "failed, or went quiet) or unobserved (neither; without --ray-address).",
        "",
        (Label("state", PLUGIN_WINDOW_READERS, "What reads the window."),),
    ),
    # Resumes.
    MetricSpec("tqmon_resumes_total", MetricType.COUNTER, "Resumes from a checkpoint observed for this run."),
    MetricSpec(
        "tqmon_last_resume_timestamp_seconds",
        MetricType.GAUGE,
        "When the last trainer start (resume or fresh start) was first observed.",
        "seconds",
    ),
    MetricSpec(
        "tqmon_last_resume_checkpoint_step",
        MetricType.GAUGE,
        "Checkpoint step N the last start resumed from (0 for a fresh start).",
    ),
    MetricSpec(
        "tqmon_resume_restored_prompt_groups",
        MetricType.GAUGE,
        f"Prompt groups R restored from TransferQueue at the last start. {_BY_STATUS}",
        "prompt_groups",
        (STATUS,),
    ),
    MetricSpec(
        "tqmon_resume_reissued_prompt_groups",
        MetricType.GAUGE,
        "In-flight (pending/running) restored prompt groups K re-issued at the last start.",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_resume_warmup_target_prompt_groups",
        MetricType.GAUGE,
        "Target window T in force at the last start.",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_resume_warmup_expected_prompt_groups",
        MetricType.GAUGE,
        "Warmup prompts verl 0.9.1 should submit at the last start: max(0, T - R), computed by tqmon.",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_resume_warmup_submitted_prompt_groups",
        MetricType.GAUGE,
        "Warmup prompts the trainer actually submitted at the last start.",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_resume_over_restored_prompt_groups",
        MetricType.GAUGE,
        "Restored prompt groups beyond the target O = max(0, R - T); kept, never trimmed.",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_resume_doomed_prompt_groups",
        MetricType.GAUGE,
        "Restored prompt groups the first sample after the last start evicts, by reason (each counted once).",
        "prompt_groups",
        (REASON,),
    ),
    MetricSpec(
        "tqmon_resume_under_submitted_prompt_groups",
        MetricType.GAUGE,
        "Useful work missing right after the last warmup: max(0, T - (R - doomed + M)).",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_resume_under_submitted_lower_bound",
        MetricType.GAUGE,
        "1 when tqmon_resume_under_submitted_prompt_groups is only a lower bound (a doom reason is not known and "
        "counts as 0; tqmon_resume_doomed_prompt_groups lacks its series), 0 when it is exact.",
    ),
    MetricSpec(
        "tqmon_resume_self_heal_prompt_groups",
        MetricType.GAUGE,
        "Fresh prompt groups the verl plugin's self-heal submitted after the last start's warmup (`on`), or would "
        "have (`dry-run`): the deficit, capped; they count in M, so the deficit after an `on` top-up is 0.",
        "prompt_groups",
        (SELF_HEAL_MODE,),
        Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_resume_first_step_evicted_prompt_groups",
        MetricType.GAUGE,
        "Prompt groups the first sample after the last start really evicted, by reason (verl's step metrics); "
        "compare with tqmon_resume_doomed_prompt_groups.",
        "prompt_groups",
        (REASON,),
    ),
    MetricSpec(
        "tqmon_resume_first_step_generation_wait_seconds",
        MetricType.GAUGE,
        "How long the first step after the last start waited for rollouts (verl timing_s/gen).",
        "seconds",
    ),
    MetricSpec(
        "tqmon_resume_warmup_state",
        MetricType.STATESET,
        "What the warmup did at the last start.",
        "",
        (Label("state", tuple(WarmupState), "Warmup decision."),),
    ),
    MetricSpec(
        "tqmon_resume_source_disagreements",
        MetricType.GAUGE,
        "Sources that contradict each other (or themselves) about a quantity of the last start, beyond legitimate"
        " differences (0: they agree; absent: fewer than two reports to compare); /api/v1/status names each"
        " source, its value and when.",
        "",
        (
            Label(
                "quantity",
                QUANTITIES,
                "R (`restored`, `restored_<status>`), K (`reissued`), T (`target`), M (`submitted`), the first"
                " live window after warmup against R + M (`window_after_warmup`), the loaded checkpoint's"
                " composition against the first live window (`checkpoint_window`).",
            ),
        ),
    ),
    # Checkpoint directory prediction.
    MetricSpec(
        "tqmon_checkpoint_step",
        MetricType.GAUGE,
        "Step N of the latest checkpoint seen.",
    ),
    MetricSpec(
        "tqmon_checkpoint_prompt_groups",
        MetricType.GAUGE,
        f"Prompt groups a resume from the latest checkpoint would restore. {_BY_STATUS}",
        "prompt_groups",
        (STATUS,),
    ),
    MetricSpec(
        "tqmon_checkpoint_doomed_prompt_groups",
        MetricType.GAUGE,
        "Prompt groups the first sample after a resume from the latest checkpoint would evict, by reason "
        "(filtered under DAPO only with algorithm.filter_groups.metric: read from the storage units).",
        "prompt_groups",
        (REASON,),
    ),
    MetricSpec(
        "tqmon_checkpoint_orphan_trajectories",
        MetricType.GAUGE,
        "Trajectory keys without a prompt key in the latest checkpoint.",
        "trajectories",
    ),
    MetricSpec(
        "tqmon_checkpoint_warmup_submitted_prompt_groups",
        MetricType.GAUGE,
        f"Warmup prompts M a resume from the latest checkpoint would submit, {_EACH_WARMUP}; needs the trainer config.",
        "prompt_groups",
        (SEMANTICS_LABEL,),
        stability=Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_checkpoint_over_filled_prompt_groups",
        MetricType.GAUGE,
        f"max(0, R + M - T) of a resume from the latest checkpoint, {_EACH_WARMUP}: the window above T after"
        " the warmup, never trimmed.",
        "prompt_groups",
        (SEMANTICS_LABEL,),
        stability=Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_checkpoint_under_submitted_prompt_groups",
        MetricType.GAUGE,
        f"max(0, T - (R - doomed + M)) of a resume from the latest checkpoint, {_EACH_WARMUP}; a lower bound while"
        " a doom reason has no tqmon_checkpoint_doomed_prompt_groups series.",
        "prompt_groups",
        (SEMANTICS_LABEL,),
        stability=Stability.EXPERIMENTAL,
    ),
    # The live TransferQueue poller and its load on the controller.
    MetricSpec(
        "tqmon_tq_poll_interval_seconds",
        MetricType.GAUGE,
        "Poll interval in force: the fast end after a resume, else the steady one; longer if --tq-budget needs.",
        "seconds",
        stability=Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_tq_controller_busy_ratio",
        MetricType.GAUGE,
        "Estimated share of the TQ controller's request thread taken by tqmon's kv_list polls (cost / period).",
        "ratio",
        stability=Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_tq_reply_keys",
        MetricType.GAUGE,
        "Keys in the last kv_list reply, all partitions (absent while the controller is unreachable).",
        "keys",
        stability=Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_tq_controller_epochs_total",
        MetricType.COUNTER,
        "TransferQueue controllers seen; a controller with a new id is a new epoch of the run (a trainer restart).",
    ),
    # Trainer progress and identity.
    MetricSpec("tqmon_trainer_global_step", MetricType.GAUGE, "Last trainer global step observed."),
    MetricSpec(
        "tqmon_trainer_step_duration_seconds",
        MetricType.GAUGE,
        "Mean duration of the trainer's last 10 steps (verl timing_s/step); the step rate is its inverse.",
        "seconds",
    ),
    MetricSpec(
        "tqmon_trainer_last_event_timestamp_seconds",
        MetricType.GAUGE,
        "When the trainer was last heard from (any source).",
        "seconds",
    ),
    MetricSpec(
        "tqmon_trainer_last_step_timestamp_seconds",
        MetricType.GAUGE,
        "When a completed or saved step last moved the trainer's global step on (any source): the trainer"
        " progresses. A resume going back to its checkpoint's step is not a step.",
        "seconds",
    ),
    MetricSpec(
        "tqmon_run_info",
        MetricType.INFO,
        "Identity of the monitored run.",
        "",
        (
            Label(
                "run_id",
                None,
                "Run id from the run_started event, else `<trainer.project_name>/<trainer.experiment_name>` "
                "from --trainer-config, else empty.",
            ),
            Label("trainer_mode", TRAINER_MODES, "trainer.v1.trainer_mode."),
            Label("verl_version", None, "verl version reported or inferred, else empty."),
        ),
    ),
    MetricSpec(
        "tqmon_verl_version_info",
        MetricType.INFO,
        "The verl release tqmon's predictions assume, and where it learnt it. Sources, most believed first: the"
        " verl plugin's run_started, the trainer log's own lines, --verl-version, the verl installed next to tqmon.",
        "",
        (
            Label("verl_version", None, "As the source gave it; from the log `<0.9.1` or `>=0.9.1`; empty: unknown."),
            Label("semantics", (*SEMANTICS, "unknown"), "Its warmup; `unknown`: predictions give each warmup."),
            Label("source", (*VERSION_SOURCES, "unknown"), "Where it came from; `unknown`: no source said."),
        ),
        stability=Stability.EXPERIMENTAL,
    ),
    MetricSpec(
        "tqmon_build_info",
        MetricType.INFO,
        "tqmon build information.",
        "",
        (Label("version", None, "tqmon version."),),
    ),
    # Health of each source.
    MetricSpec(
        "tqmon_source_up",
        MetricType.GAUGE,
        "1 if the source's last attempt succeeded and its data is fresh, else 0.",
        "",
        (SOURCE,),
    ),
    MetricSpec(
        "tqmon_source_last_success_timestamp_seconds",
        MetricType.GAUGE,
        "When the source last succeeded.",
        "seconds",
        (SOURCE,),
    ),
    MetricSpec(
        "tqmon_source_poll_duration_seconds",
        MetricType.GAUGE,
        "Duration of the source's last poll or read.",
        "seconds",
        (SOURCE,),
    ),
    MetricSpec(
        "tqmon_source_errors_total",
        MetricType.COUNTER,
        "Failed polls, reads and malformed records of a source.",
        "",
        (SOURCE, Label("reason", SOURCE_ERROR_REASONS, "Error class.")),
    ),
    MetricSpec(
        "tqmon_events_total",
        MetricType.COUNTER,
        "Events accepted from each source; duplicates (an id seen before) are accepted once and not applied.",
        "",
        (SOURCE, Label("outcome", EVENT_OUTCOMES, "applied or duplicate.")),
    ),
    MetricSpec(
        "tqmon_events_rejected_total",
        MetricType.COUNTER,
        "Event API requests rejected, by reason; a rejected request changes no state.",
        "",
        (Label("reason", REJECT_REASONS, "Why the request was rejected."),),
    ),
    MetricSpec(
        "tqmon_log_lines_total",
        MetricType.COUNTER,
        "Trainer log lines read: turned into an event, ignored (other output), or malformed (skipped).",
        "",
        (Label("outcome", LOG_LINE_OUTCOMES, "What happened to the line."),),
    ),
    MetricSpec(
        "tqmon_checkpoint_pickle_refusals_total",
        MetricType.COUNTER,
        "controller_state.pkl files refused unread, by reason: a global outside the allowlist, a length past the "
        "end of the file, a memo index with a gap, containers nested too deep, truncated or malformed; nothing runs.",
        "",
        (Label("reason", PICKLE_REFUSAL_REASONS, "Why the pickle was refused."),),
    ),
    # The state dir (docs/reliability.md).
    MetricSpec(
        "tqmon_state_writable",
        MetricType.GAUGE,
        "1 while the state dir takes writes; 0 while it refuses them (read-only, full, deleted): tqmon then "
        "serves from memory and answers posted events 503.",
    ),
    MetricSpec(
        "tqmon_state_write_failures_total",
        MetricType.COUNTER,
        "State dir writes refused, by reason; counted in memory since the disk is what failed.",
        "",
        (Label("reason", STATE_WRITE_FAILURE_REASONS, "read_only, no_space, missing or io_error."),),
    ),
    # OTLP push (only with --otlp-endpoint).
    MetricSpec(
        "tqmon_otlp_export_failures_total",
        MetricType.COUNTER,
        "OTLP exports that failed after the SDK's retries (Collector down, slow or answering an error), by signal.",
        "",
        (Label("signal", OTLP_SIGNALS, "OTLP signal: `metrics` or `logs`."),),
    ),
    MetricSpec(
        "tqmon_otlp_log_records_dropped_total",
        MetricType.COUNTER,
        "Resume log records dropped undelivered because the bounded OTLP log queue was full.",
    ),
    # What the last resume cost (ml-goodput-measurement's badput); absent when unknown or after a fresh start.
    MetricSpec(
        "tqmon_resume_lost_steps",
        MetricType.GAUGE,
        "Steps trained after the checkpoint the last resume loaded and lost at the stop: the last step completed "
        "before the stop minus the checkpoint step N.",
        "steps",
    ),
    MetricSpec(
        "tqmon_resume_downtime_seconds",
        MetricType.GAUGE,
        "From the trainer's last timestamped activity before the stop to the last resume's first line.",
        "seconds",
    ),
    MetricSpec(
        "tqmon_resume_time_to_first_step_seconds",
        MetricType.GAUGE,
        "From the last resume's first line until its first step completed: restore, re-issue, warmup and the "
        "step itself (the warmup line's time plus verl's timing_s/step).",
        "seconds",
    ),
    MetricSpec(
        "tqmon_resume_wasted_rollouts",
        MetricType.GAUGE,
        "Rollouts of the restored groups the first sample after the last resume evicts: doomed prompt groups "
        "times actor_rollout_ref.rollout.n.",
        "rollouts",
    ),
    MetricSpec(
        "tqmon_resume_lost_prompt_groups",
        MetricType.GAUGE,
        "Prompt groups the last resume lost because its checkpoint held no transfer_queue/ (warmup state"
        " lost_window): the last live window seen before the restart, or the previous checkpoint's composition;"
        " 0 when the resume restored its window (or keeps none).",
        "prompt_groups",
    ),
    MetricSpec(
        "tqmon_resume_step_regression_steps",
        MetricType.GAUGE,
        "Steps the last start went back, by why (0: none): the newest step saved before it (a global_step_N folder"
        " or a trainer's save) minus the step it began at (0 for a fresh start), and steps logged twice since;"
        " /api/v1/status has both steps in the record's step_regressions and evidence.",
        "steps",
        (
            Label(
                "reason",
                tuple(RegressionReason),
                "`latest_file_missing` (no latest_checkpointed_iteration.txt), `latest_file_stale` (it names an"
                " older step), `resume_choice` (verl loaded another: trainer.resume_mode/resume_from_path),"
                " `unknown` (no checkpoint dir watched, or its latest file changed since), `step_repeated`.",
            ),
        ),
    ),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}
