"""The runs behind the README's table of model families profiled with no flags.

    python docs/families_table.py [FOLDER]      # prints the Markdown table

Builds one tiny model per family from a config (tests/fixtures/family_models.py, random
weights), then runs ``fp16probe profile MODEL`` on each with no flags (10 fp32 steps on the
CPU) and reads the loss and the verdict back from the report.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from family_models import save_hf_models  # noqa: E402

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="fp16probe-families-"))
folders = save_hf_models(out / "hf")
env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "fixtures")])}
models = [(str(folders[name]), name) for name in folders] + [
    ("family_models:TinyResNet", "torchvision-style ResNet (tests)"),
    ("family_models:Regressor", "nn.Module with a [batch, 1] output"),
]
print("| model | family | loss used | verdict |")
print("|---|---|---|---|")
for model, label in models:
    report = out / f"{label.split()[0]}.json"
    subprocess.run([sys.executable, "-m", "fp16probe", "profile", model, "--out", str(report), "--json"],
                   check=True, env=env, cwd=out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = json.loads(report.read_text())
    work, rec = data["workload"], data["recommendation"]  # what ran: the report's workload section
    scale = "" if rec["log2_scale"] in (None, 0) else f", S = 2^{rec['log2_scale']}"
    loss = work["loss"].split(", on invented labels")[0]
    print(f"| `{data['metadata']['model_class']}` | {work.get('family', '')} | {loss} | "
          f"{rec['verdict']}{scale} (flushed at S = 1: {rec['flushed_fraction_at_1']:.2%}) |")
