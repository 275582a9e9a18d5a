"""`make demo` runs `tqmon demo`: the bundled log replayed live must end in the documented verdicts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import free_port, sample_value


def test_demo_replays_the_bundled_run_and_stops_on_ctrl_c() -> None:
    port = free_port()
    command = [sys.executable, "-m", "tqmon.cli", "demo", "--listen", f"127.0.0.1:{port}", "--speed", "400"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                text = ""
            over = sample_value(text, "tqmon_resume_over_restored_prompt_groups")
            if over == 32.0 and sample_value(text, 'tqmon_window_status{status="over_filled"}') == 1.0:
                break
            time.sleep(0.2)
        # Fresh start (T=96), healthy resume from 40, then a resume from 60 after num_warmup_batches 1.5 -> 1.
        assert sample_value(text, "tqmon_resumes_total") == 2.0
        assert sample_value(text, "tqmon_last_resume_checkpoint_step") == 60.0
        assert sample_value(text, "tqmon_resume_warmup_target_prompt_groups") == 64.0
        assert sample_value(text, 'tqmon_resume_warmup_state{state="skipped_over_restored"}') == 1.0
        assert sample_value(text, 'tqmon_window_status{status="over_filled"}') == 1.0
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=15)[0].decode()
    assert proc.returncode == 0, output
    assert f"http://127.0.0.1:{port}/metrics" in output
