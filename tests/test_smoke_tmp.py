import torch, replicator as rp
from replicator.testing import run_replicas

def body():
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(repl.replica_id)
        model = torch.nn.Linear(4, 2)
        opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    def step_fn(ctx, batch):
        loss = model(batch).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        return ctx.all_mean(loss.detach())
    outs = [o for _, o in repl.run(step_fn, [x, x, x])]
    return [p.detach().clone() for p in model.parameters()], outs, repl.last_run

def test_smoke():
    r = run_replicas(body, 2)
    print(r[0][2])
    assert torch.allclose(r[0][0][0], r[1][0][0])
