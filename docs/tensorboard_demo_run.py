"""The run behind docs/images/tensorboard-histograms.png: a real Lightning fit, logged live.

    python docs/tensorboard_demo_run.py            # writes /tmp/fp16probe-tb-demo/tb
    tensorboard --logdir /tmp/fp16probe-tb-demo/tb --host 127.0.0.1 --port 6123 &
    chromium-headless-shell --no-sandbox --disable-gpu --hide-scrollbars \
        --force-device-scale-factor=2 --window-size=1050,800 --virtual-time-budget=20000 \
        --screenshot=shot.png \
        "http://127.0.0.1:6123/?darkMode=false#histograms&tagFilter=fp16probe%2F(activation%7Cweight)_grad%24"

The picture in the README is the top of that screenshot (Debian's chromium-headless-shell
156), scaled to 1400 pixels wide.
"""

import itertools
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from fp16probe.integrations.lightning import Fp16ProbeCallback
from fp16probe.running.demo import DemoNet, demo_batches, demo_loss

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp16probe-tb-demo"


class Demo(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = DemoNet()

    def training_step(self, batch, i):
        loss = demo_loss(self.net(batch[0]), batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


data = list(itertools.islice(demo_batches(), 60))
callback = Fp16ProbeCallback(log_every=10, dirpath=OUT)
trainer = pl.Trainer(accelerator="cpu", max_steps=60, logger=TensorBoardLogger(f"{OUT}/tb", name="demo"),
                     log_every_n_steps=10, enable_checkpointing=False, enable_progress_bar=False,
                     callbacks=[callback], default_root_dir=OUT)
trainer.fit(Demo(), torch.utils.data.DataLoader(data, batch_size=None))
rec = callback.report.recommendation
print(f"{rec.verdict}: S = 2^{rec.log2_scale}; flushed at S = 1: {rec.flushed_fraction_at_1:.2%}, "
      f"at S: {rec.flushed_fraction_at_scale:.3%}")
