"""A character-level GPT on Python's own documentation, cut into 2 pipeline stages (GPipe) and replicated twice.

    replicator launch -n 4 examples/transformer_pipeline.py                  # 2 stages x 2 replicas, a minute or two
    replicator launch -n 4 examples/transformer_pipeline.py --steps 3000 --n-layer 8 --n-embd 256 --block-size 128
    replicator launch -n 4 examples/transformer_pipeline.py --steps 20 --trace runs/trace   # Chrome trace + Gantt PNG
    replicator launch -n 2 examples/transformer_pipeline.py --stages 1       # data parallelism alone
    python examples/transformer_pipeline.py --stages 1                       # one process

The text is the reference documentation that ships with CPython (`pydoc_data.topics`, the
pages `help("assert")` shows): about 465,000 characters, nothing to download. The world of
processes is replicas x stages: with 4 processes and --stages 2, processes 0-1 are replica
0's two stages and processes 2-3 replica 1's. Each mini-batch is split into --chunks
micro-batches that flow through the stages; gradients are then averaged across replicas,
stage by stage, and every replica takes the same optimizer step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import replicator as rp
from replicator.pipeline import plot_gantt, write_chrome_trace

# -- data ---------------------------------------------------------------------------------------


def load_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


class CharWindows(torch.utils.data.Dataset):
    """Every window of block_size + 1 characters: the inputs, and the same shifted by one as targets."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i : i + self.block_size + 1]
        return window[:-1], window[1:]


def load_data(block_size: int) -> tuple[list[str], CharWindows, CharWindows]:
    """The character vocabulary, and the first 90% of the text for training, the rest for validation."""
    text = load_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(0.9 * len(tokens))
    return chars, CharWindows(tokens[:cut], block_size), CharWindows(tokens[cut:], block_size)


# -- model: a list of layers, each taking the previous one's output ---------------------------


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


class Embedding(nn.Module):
    """Token and position embeddings: (B, T) character ids -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.n_embd)
        self.position = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.token(idx) + self.position(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """A pre-norm transformer block: (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm and the language-model head: (B, T, C) -> (B, T, vocab) logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd)
        # Not tied to the token embedding: the two live on different stages (processes).
        self.out = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_layers(config: GPTConfig) -> list[nn.Module]:
    layers = [Embedding(config), *[Block(config) for _ in range(config.n_layer)], Head(config)]
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)  # GPT-2's initialisation
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
    return layers


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- training -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages; the processes form replicas x stages")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (GPipe's M)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32, help="global: split across replicas, then into chunks")
    parser.add_argument("--block-size", type=int, default=64, help="characters of context")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--trace", metavar="DIR", default=None, help="write the last training step's timeline to DIR "
                        "(Chrome trace and Gantt chart)")
    parser.add_argument("--report", metavar="DIR", default=None, help="each process writes what it saw to DIR as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    repl = rp.Replicator(stages=args.stages, chunks=args.chunks)
    chars, train_data, val_data = load_data(args.block_size)
    config = GPTConfig(len(chars), args.block_size, args.n_layer, args.n_head, args.n_embd)

    with repl.scope():
        torch.manual_seed(args.seed)  # every process builds the same whole model; each keeps its own stage
        pipe = repl.pipeline(gpt_layers(config), balance="params")
        optimizer = repl.wrap_optimizer(torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0))

    # The last stage holds the logits, so the last stage of replica 0 is the one that reports.
    reporter = pipe.is_last and repl.replica_id == 0

    def log(message: str) -> None:
        if reporter:
            print(message, flush=True)

    parameters = sum(p.numel() for p in pipe.parameters())
    log(f"{repl.num_replicas} replica(s) x {repl.num_stages} stage(s), {args.chunks} micro-batches per mini-batch; "
        f"this stage holds {parameters:,} parameters; vocabulary of {len(chars)} characters, "
        f"{len(train_data) + len(val_data):,} characters of text")

    def input_fn(ctx: rp.InputContext) -> torch.utils.data.DataLoader:
        # The sampler depends on the replica, not the process: the two stages of a replica
        # draw the same windows (the first stage reads the inputs, the last the targets).
        return torch.utils.data.DataLoader(
            train_data, batch_size=ctx.per_replica_batch_size(args.batch_size),
            sampler=ctx.sampler(train_data, shuffle=True, seed=args.seed), drop_last=True,
        )

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        optimizer.zero_grad()
        loss = pipe.train_step(inputs, targets, loss_fn)  # every micro-batch, forward then backward
        optimizer.step()  # gradients averaged across the replicas of this stage
        return ctx.all_mean(loss)

    @torch.no_grad()
    def val_loss(ctx: rp.ReplicaContext) -> float:
        # Fixed windows per replica; both stages of a replica pick the same ones.
        generator = torch.Generator().manual_seed(args.seed + 1 + repl.replica_id)
        per_replica = args.batch_size // repl.num_replicas
        pipe.eval()
        total = torch.zeros(())
        for _ in range(args.eval_batches):
            starts = torch.randint(len(val_data), (per_replica,), generator=generator).tolist()
            inputs, targets = (torch.stack(t) for t in zip(*(val_data[i] for i in starts)))
            logits = pipe.eval_step(inputs)  # the logits on the last stage, None on the others
            if pipe.is_last:
                total += loss_fn(logits, targets)
        pipe.train()
        return float(ctx.all_mean(total / args.eval_batches))  # meaningful on the last stage

    tokens_per_step = args.batch_size * args.block_size
    losses: list[float] = []
    val_losses: dict[int, float] = {}
    started, since = time.perf_counter(), 0
    for step, loss in repl.run(step_fn, repl.prepare_input(input_fn), steps=args.steps, progress=False):
        losses.append(float(loss))
        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - started
            rate = tokens_per_step * (step + 1 - since) / elapsed
            log(f"step {step + 1:5d} | loss {float(loss):.4f} | {rate:,.0f} tokens/s")
            started, since = time.perf_counter(), step + 1
        if args.trace and step + 1 == args.steps:
            # Before evaluating: eval_step records its own (forward-only) timeline.
            events = pipe.gather_timeline()  # this replica's stages; every stage must call it
            if repl.is_main:
                os.makedirs(args.trace, exist_ok=True)
                write_chrome_trace(events, os.path.join(args.trace, "pipeline_trace.json"))
                plot_gantt(events, os.path.join(args.trace, "pipeline_gantt.png"),
                           title=f"replica 0, {repl.num_stages} stages x {args.chunks} micro-batches")
                print(f"timeline of step {step + 1} written to {args.trace}", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_losses[step + 1] = val_loss(repl.context)
            log(f"step {step + 1:5d} | val loss {val_losses[step + 1]:.4f}")
            started, since = time.perf_counter(), step + 1  # evaluation is not training throughput

    if args.report:
        # What a test needs to check the run: the layout, the losses, and this stage's
        # parameters (replicas of one stage must hold identical ones).
        os.makedirs(args.report, exist_ok=True)
        flat = torch.cat([p.detach().reshape(-1) for p in pipe.parameters()]).double()
        record = {
            "stage": repl.stage_id, "replica": repl.replica_id, "stages": repl.num_stages,
            "replicas": repl.num_replicas, "losses": losses, "val_losses": val_losses,
            "parameters": parameters, "checksum": [float(flat.sum()), float(flat.square().sum())],
            "finite": all(math.isfinite(x) for x in losses),
        }
        with open(os.path.join(args.report, f"stage{repl.stage_id}_replica{repl.replica_id}.json"), "w") as handle:
            json.dump(record, handle)


if __name__ == "__main__":
    main()
