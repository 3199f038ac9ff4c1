""".ci/run's handling of a short disk, run for real with stand-ins for ``make`` and ``df``:
torch 2.15's set-up goes beside the slow suite where the disk has room for both, after it
(the 2.13 venv the run made removed first, if need be) where it has less, and is skipped,
said loudly in the summary, where it has less still; a disk that fills up during the set-up
sends it round again, alone. torch 2.11's set-up comes last, after the venvs the run made
and has done with are removed where the disk is short, and is never skipped: too little
disk even then fails CI. Any other failure fails CI. CI once failed on a full disk while
that set-up unpacked beside the slow suite. No torch: bash alone, ~1 s a case."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch_independent

ROOT = Path(__file__).parent.parent
FULL = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"

# `make`: logs its arguments; `make setup` makes $VENV/.installed; the command named by
# $FAIL_ON prints $FAIL_MSG and fails ($FAIL_ONCE: the first time only)
MAKE = """#!/bin/bash
echo "$*" >> "$STUB_LOG"
venv=.venv
for a in "$@"; do case $a in VENV=*) venv=${a#VENV=};; esac; done
if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]] && [ ! -e "$STUB_LOG.failed" ]; then
    [ -z "$FAIL_ONCE" ] || touch "$STUB_LOG.failed"
    echo "$FAIL_MSG"; exit 3
fi
[ "$1" != setup ] || { mkdir -p "$venv" && touch "$venv/.installed"; }
"""
# `df -Pk DIR...`: $FREE_GB free, $VENV_GB more once .venv is gone, 5 less for each of
# .venv-215 and .venv-211 there (each keeps 5.4 GB)
DF = """#!/bin/bash
g=$FREE_GB; [ -d .venv ] || g=$((g + VENV_GB)); [ ! -d .venv-215 ] || g=$((g - 5)); [ ! -d .venv-211 ] || g=$((g - 5))
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
for d in "$@"; do case $d in -*) ;; *) echo "/dev/x 1 1 $((g * 1048576)) 1% $d";; esac; done
"""


def _ci(tmp_path: Path, free_gb: int, venv_gb: int = 0, fail_on: str = "", fail_msg: str = "", once: bool = False,
        venv_exists: bool = False) -> tuple[int, str, list[str], Path]:
    """Run .ci/run in a bare copy of the repository with the stand-ins: (exit status, output,
    the make commands in order, the copy)."""
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    if venv_exists:
        (repo / ".venv").mkdir()
        (repo / ".venv" / ".installed").touch()
    bin_.mkdir()
    for name, text in {"make": MAKE, "df": DF, "qemu-aarch64": "#!/bin/bash\n"}.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    log = tmp_path / "make.log"
    log.touch()
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "STUB_LOG": str(log), "FREE_GB": str(free_gb),
           "VENV_GB": str(venv_gb), "FAIL_ON": fail_on, "FAIL_MSG": fail_msg, "FAIL_ONCE": "1" if once else ""}
    run = subprocess.run(["bash", ".ci/run"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    return run.returncode, run.stdout + run.stderr, log.read_text().splitlines(), repo


SETUP_215 = "setup VENV=.venv-215 TORCH=2.15.0"
TEST_215 = "test VENV=.venv-215 TORCH=2.15.0 MARKS=not slow and not torch_independent"
SETUP_211 = "setup VENV=.venv-211 TORCH=2.11.0"
TEST_211 = "test VENV=.venv-211 TORCH=2.11.0 MARKS=not slow and not torch_independent"
RANKS_211 = ("test VENV=.venv-211 TORCH=2.11.0 MARKS=slow TESTS=tests/test_train_parity.py::"
             "test_invariant_training_matches_the_single_process[DDP=2] "
             "tests/test_fqn_streams.py::test_fqn_streams_on_tp_fsdp_and_fsdp_tp_gloo")
LAST_211 = [SETUP_211, TEST_211, RANKS_211]


def test_with_room_the_215_setup_runs_beside_the_slow_suite(tmp_path):
    status, out, made, repo = _ci(tmp_path, free_gb=50)
    assert status == 0, out
    assert made == ["setup", "lint", "test", SETUP_215, "test-slow", TEST_215, *LAST_211] or \
        made == ["setup", "lint", "test", "test-slow", SETUP_215, TEST_215, *LAST_211]  # the two race
    assert "beside the slow suite" in out and "SKIPPED" not in out and (repo / ".venv").is_dir()


def test_short_of_room_it_runs_after_the_slow_suite_keeping_the_venv(tmp_path):
    status, out, made, repo = _ci(tmp_path, free_gb=10)
    assert status == 0, out
    assert made == ["setup", "lint", "test", "test-slow", SETUP_215, TEST_215, *LAST_211]
    assert "waits for the slow suite" in out and "removing the 2.13 venv" not in out
    # 2.15's venv leaves 5 GB: both venvs the run made go before 2.11's set-up
    assert "5 GB free: removing the venvs this run made" in out and not (repo / ".venv").exists()


def test_shorter_still_the_venv_the_run_made_goes_first(tmp_path):
    status, out, made, repo = _ci(tmp_path, free_gb=6, venv_gb=3)
    assert status == 0, out
    assert made == ["setup", "lint", "test", "test-slow", SETUP_215, TEST_215, *LAST_211]
    assert not (repo / ".venv").exists() and "removing the 2.13 venv" in out
    # 2.15's venv leaves 4 GB: it goes too, once its suite is done
    assert "4 GB free: removing the venvs this run made" in out and not (repo / ".venv-215").exists()


def test_a_venv_the_run_did_not_make_stays_and_215_is_skipped_loudly(tmp_path):
    status, out, made, repo = _ci(tmp_path, free_gb=6, venv_gb=3, venv_exists=True)
    assert status != 0, out  # torch 2.11 is never skipped: too little disk fails CI
    assert made == ["setup", "lint", "test", "test-slow"]
    assert (repo / ".venv" / ".installed").exists()
    assert "!!! SKIPPED for want of disk: torch 2.15.0's set-up and suite (6 GB free" in out
    assert "!!! FAILED for want of disk: torch 2.11.0's set-up needs 8 GB, 6 GB free" in out


def test_a_disk_that_fills_during_the_setup_sends_it_round_again_alone(tmp_path):
    status, out, made, _ = _ci(tmp_path, free_gb=50, fail_on=SETUP_215, fail_msg=FULL, once=True)
    assert status == 0, out
    assert made.count(SETUP_215) == 2 and made[-4:] == [TEST_215, *LAST_211]
    assert "the disk filled up" in out and "set-up (torch 2.15.0), alone" in out and "SKIPPED" not in out


def test_a_disk_that_fills_twice_skips_215_loudly(tmp_path):
    status, out, made, _ = _ci(tmp_path, free_gb=50, fail_on=SETUP_215, fail_msg=FULL)
    assert status == 0, out
    assert made.count(SETUP_215) == 2 and TEST_215 not in made and made[-3:] == LAST_211
    assert "!!! SKIPPED for want of disk" in out


@pytest.mark.parametrize("fail_on", [SETUP_215, "test-slow", TEST_215, SETUP_211, TEST_211])
def test_any_other_failure_fails_ci(tmp_path, fail_on):
    status, out, made, _ = _ci(tmp_path, free_gb=50, fail_on=fail_on, fail_msg="boom")
    assert status == 3, out
    assert "(failed: exit 3)" in out and "SKIPPED" not in out
