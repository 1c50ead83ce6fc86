#!/usr/bin/env python3
"""PyTorch + timm side of benches/vit-vs-timm.sh: the training step of timm's VisionTransformer
at toy's vit-tiny shape on the images of an ImageFolder tree, on the CPU.

    vit_timm_step.py DATA_DIR IMAGE_SIZE STEPS OUT_JSON [--batch 64] [--threads 2]

Images are decoded with PIL once, resized (shorter side, bilinear) and centre-cropped to
IMAGE_SIZE, ImageNet-normalized: toy's evaluation transform, so both sides see the same pixels.
A step is forward, cross-entropy, backward, global-norm clipping to 1 and AdamW (lr 2e-3,
weight decay 0.05, betas 0.9/0.999), as toy's default vit-tiny run. Prints and writes the median
step time over steps 5..STEPS.
"""
import argparse, json, os, statistics, time

import torch
import torch.nn.functional as F
import timm
from PIL import Image

ap = argparse.ArgumentParser()
ap.add_argument("data")
ap.add_argument("size", type=int)
ap.add_argument("steps", type=int)
ap.add_argument("out")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)

classes = sorted(d for d in os.listdir(args.data) if os.path.isdir(os.path.join(args.data, d)))
samples = []
for c, name in enumerate(classes):
    for root, _, files in sorted(os.walk(os.path.join(args.data, name))):
        samples += [(os.path.join(root, f), c) for f in sorted(files) if f.lower().endswith((".png", ".jpg", ".jpeg"))]
mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def load(path):
    img = Image.open(path).convert("RGB")
    w, h = img.size
    s = args.size
    rw, rh = (s, max(s, h * s // w)) if w <= h else (max(s, w * s // h), s)
    img = img.resize((rw, rh), Image.BILINEAR)
    left, top = (rw - s) // 2, (rh - s) // 2
    img = img.crop((left, top, left + s, top + s))
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(s, s, 3)
    return (x.permute(2, 0, 1).float() / 255 - mean) / std


images = torch.stack([load(p) for p, _ in samples])
labels = torch.tensor([c for _, c in samples])
model = timm.models.vision_transformer.VisionTransformer(
    img_size=args.size, patch_size=4, embed_dim=96, depth=4, num_heads=3, mlp_ratio=4,
    num_classes=len(classes))
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, betas=(0.9, 0.999))
model.train()
times = []
g = torch.Generator().manual_seed(0)
for step in range(args.steps):
    idx = torch.randperm(len(samples), generator=g)[: args.batch]
    t = time.perf_counter()
    loss = F.cross_entropy(model(images[idx]), labels[idx])
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t)
result = {
    "ms_per_step": 1000 * statistics.median(times[4:]),
    "params": sum(p.numel() for p in model.parameters()),
    "torch": torch.__version__,
    "timm": timm.__version__,
    "images": len(samples),
}
json.dump(result, open(args.out, "w"))
print(result)
