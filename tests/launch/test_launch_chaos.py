"""scripts/chaos.py --dry-run prints the reference command and one chaos command per kill + 1."""
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chaos_dry_run_prints_reference_and_resumed_runs(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--dry-run", "--kills", "2",
                          "--steps", "3", "--out", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(line[2:].split("  #")[0]) for line in res.stdout.splitlines() if line.startswith("+ ")]
    assert len(cmds) == 4
    dirs = [next(a for a in c if a.startswith("--config.trainer.default_local_dir=")) for c in cmds]
    assert dirs[0].endswith("/reference") and all(d.endswith("/chaos") for d in dirs[1:])
    assert all("--config.trainer.total_training_steps=3" in c and "--config.trainer.save_freq=1" in c
               for c in cmds)
    assert not (tmp_path / "reference").exists()  # a dry run runs nothing
