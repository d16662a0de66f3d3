"""A job for ``torchrun --max-restarts``: test_restart's model and layout, one worker killed once."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_restart import model, train  # noqa: E402

if __name__ == "__main__":
    layout, rank, at, marker, ckpt, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    result = train(model(layout, rank, at, marker), layout, checkpoint_dir=ckpt)
    if os.environ["RANK"] == "0":
        torch.save(result.model.state_dict(), out)
        with open(out + ".json", "w") as f:
            json.dump(result.history, f)
