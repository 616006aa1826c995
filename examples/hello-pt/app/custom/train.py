"""hello-pt's training script, launched by the client-API executor (`fedhive.client`, FLARE's
client API: a FLARE `train.py` runs with `import fedhive.client as flare`): each round it
receives the global model (torch tensors, downloaded straight from S3), trains a few local
epochs of SGD on this site's digits shard and sends the new weights back, weighted by its
number of optimizer steps, with the held-out accuracy of the local and of the global model.

    python -u custom/train.py [--num-sites 2] [--epochs 5] [--lr 0.05] [--batch-size 32]
                              [--hidden 64]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from digits import site_data, site_index
from trainer import State, accuracy, train_round

import fedhive.client as flare


def options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hello-pt trainer")
    parser.add_argument("--num-sites", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    return parser.parse_args(argv)


def local_round(state: State, site: str, current_round: int, args: argparse.Namespace,
                ) -> tuple[State, int, dict[str, Any]]:
    """This site's training from the global `state`: the new state, its optimizer steps (the
    weight FedAvg gives it) and its metrics."""
    train, test = site_data(site, args.num_sites)
    seed = 1000 * current_round + site_index(site, args.num_sites)
    new, steps, loss = train_round(state, train, epochs=args.epochs, lr=args.lr,
                                   batch_size=args.batch_size, seed=seed, hidden=args.hidden)
    return new, steps, {"accuracy": accuracy(new, test, args.hidden),  # the local model
                        "global_accuracy": accuracy(state, test, args.hidden), "loss": loss}


def main() -> None:
    args = options()
    flare.init()
    site = flare.get_site_name()
    while flare.is_running():
        model = flare.receive()
        if model is None:
            break
        current_round = model.current_round or 0
        state, steps, metrics = local_round(dict(model.params), site, current_round, args)
        print(f"{site} round {current_round}: {metrics}", flush=True)
        flare.send(flare.FLModel(params=state, params_type=flare.ParamsType.FULL,
                                 metrics=metrics, meta={"NUM_STEPS_CURRENT_ROUND": steps}))


if __name__ == "__main__":
    main()
