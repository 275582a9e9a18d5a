"""podman on these machines, and a ``python:3.11-slim`` stand-in built with debootstrap (no registry here).

The stand-in is made once and cached outside the repository: the rootfs tarball under
``~/.cache/tqmon-test`` (or ``$TQMON_TEST_CACHE``) and the imported image in podman's own store.
Run ``python -m tests.podman`` to make it ahead of the test run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE_IMAGE = "python:3.11-slim"
SUITE = "bookworm"
PODMAN = ("podman", "--storage-driver", "vfs", "--runtime", "runc")
# build and run: the sandbox's default limits are above what the user namespace grants.
LIMITS = ("--network", "host", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))


def cache_dir() -> Path:
    return Path(os.environ.get("TQMON_TEST_CACHE", Path.home() / ".cache" / "tqmon-test"))


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """One podman command with this machine's storage and runtime flags."""
    return subprocess.run([*PODMAN, *args], check=check, timeout=timeout, text=True, capture_output=True)


def missing_tools() -> list[str]:
    return [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]


def _source_files() -> list[Path]:
    listed, directory = APT_SOURCES
    files = [listed] if listed.is_file() else []
    if directory.is_dir():
        files += sorted(p for p in directory.iterdir() if p.suffix in (".list", ".sources"))
    return files


def debian_mirror() -> str:
    """The URI apt uses for Debian's main archive (``<suite>`` with ``main``), read from apt's sources."""
    for path in _source_files():
        text = path.read_text()
        if path.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields = dict(
                    line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#")
                )
                suites = fields.get("Suites", "").split()
                if SUITE in suites and "main" in fields.get("Components", "").split():
                    return fields["URIs"].split()[0]
        else:
            for line in text.splitlines():
                words = [w for w in line.split() if not w.startswith("[")]
                if len(words) >= 4 and words[0] == "deb" and words[2] == SUITE and "main" in words[3:]:
                    return words[1]
    raise RuntimeError(f"no apt source for Debian {SUITE} main in {', '.join(map(str, _source_files()))}")


def _make_rootfs(tarball: Path) -> None:
    """debootstrap a minimal bookworm with Python and pip, shaped like the official slim image."""
    with tempfile.TemporaryDirectory(prefix="tqmon-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-pip,python3-venv",
                SUITE,
                str(root),
                debian_mirror(),
            ],
            check=True,
            timeout=900,
            capture_output=True,
        )
        (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        for name, target in (("python", "python3"), ("pip", "pip3")):
            (root / "usr/bin" / name).unlink(missing_ok=True)
            (root / "usr/bin" / name).symlink_to(target)
        # The package registry is reached through a proxy whose CA only the host trusts.
        ca = root / "etc/ssl/certs/tqmon-host-ca.crt"
        ca.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HOST_CA, ca)
        (root / "etc/pip.conf").write_text(f"[global]\ncert = /{ca.relative_to(root)}\n")
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(root), "-czf", str(partial), "."], check=True, timeout=600)
        partial.rename(tarball)


def ensure_base_image() -> None:
    """Import the stand-in as ``python:3.11-slim`` unless podman has it; debootstrap only without a cached tarball."""
    if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return
    tarball = cache_dir() / f"python-3.11-slim-{SUITE}-rootfs.tar.gz"
    if not tarball.exists():
        tarball.parent.mkdir(parents=True, exist_ok=True)
        _make_rootfs(tarball)
    podman(
        "import",
        "--change",
        'CMD ["python3"]',
        "--change",
        "ENV LANG=C.UTF-8",
        str(tarball),
        f"docker.io/library/{BASE_IMAGE}",
    )


def pip_build_args() -> list[str]:
    """The host's pip index settings as build arguments, so pip inside the build reaches the same registry.

    Only http(s) indexes are passed (a ``file://`` index is not visible inside the build); the proxy CA is
    already in the stand-in's /etc/pip.conf.
    """
    settings = dict(os.environ)
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        name = {"global.index-url": "PIP_INDEX_URL", "global.extra-index-url": "PIP_EXTRA_INDEX_URL"}.get(key)
        if name and name not in settings:
            settings[name] = value.strip("'\" ")
    args = []
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST"):
        urls = [u for u in settings.get(name, "").split() if name == "PIP_TRUSTED_HOST" or u.startswith("http")]
        if urls:
            args += ["--build-arg", f"{name}={' '.join(urls)}"]
    return args


def build(tag: str, context: Path, *build_args: str, timeout: float = 1800) -> float:
    """``podman build`` the unmodified Dockerfile; returns the seconds it took."""
    started = time.monotonic()
    result = podman(
        "build", "--pull=never", "--format", "docker", *LIMITS, *pip_build_args(), *build_args,
        "--tag", tag, str(context), check=False, timeout=timeout,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"podman build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return time.monotonic() - started


def image_size(tag: str) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def rss_kib(container: str, field: str = "VmRSS") -> int:
    """``VmRSS`` (or ``VmHWM``, the peak) of the container's PID 1, in KiB."""
    status = podman("exec", container, "cat", "/proc/1/status").stdout
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/1/status of {container}")


if __name__ == "__main__":
    ensure_base_image()
    print(podman("images", BASE_IMAGE).stdout, file=sys.stderr)
