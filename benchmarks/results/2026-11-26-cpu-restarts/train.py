
import os, sys, time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import gpukit as gk

steps = int(sys.argv[1])
rt = gk.Runtime(checkpoints="ck", save_every=4, seed=0, resume="auto")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
model, opt, loader = rt.setup(model, opt, DataLoader(data, batch_size=8, shuffle=True))
while rt.global_step < steps:
    for x, y in loader:
        time.sleep(0.05)
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(opt)
        if rt.global_step >= steps:
            break
rt.teardown()

