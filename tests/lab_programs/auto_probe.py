"""Lab program: the --comm auto probe on the lab's real groups; rank 0 prints its
measurements and the decision as one JSON line."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist

from fsdp_ext.comm.auto import auto_config, measure

dist.init_process_group("gloo")
node_size = int(os.environ["LOCAL_WORLD_SIZE"])
m = measure(node_size)
decision = auto_config([[0]] + [[1 << 20]] * 4, node_size=node_size, measurements=m)
if dist.get_rank() == 0:
    print(
        json.dumps(
            {
                "inter_bandwidth": m.inter.bandwidth,
                "inter_latency": m.inter.latency,
                "intra_bandwidth": m.intra.bandwidth,
                "probe_s": m.probe_s,
                "choice": decision.choice.name,
                "codecs": {k: [v.per_call, v.per_element] for k, v in m.codecs.items()},
            }
        ),
        flush=True,
    )
dist.destroy_process_group()
