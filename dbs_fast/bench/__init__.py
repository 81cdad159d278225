"""`dbs-fast bench`: the engine against the PyTorch baseline (`suite`), the logits kernel on its own
(`kernel`), random checkpoints with real shapes (`checkpoints`) and the machine a figure ran on
(`machine`). Needs the `bench` extra; the PyTorch contenders need `export`."""
