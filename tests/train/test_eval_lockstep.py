"""Two processes stop evaluating together when one's share of the file runs out.

A 7-line file read by 2 processes in batches of 4 gives process 0 two local
batches and process 1 one; an eval that stepped on alone would wait forever
on the other's collectives. Plain ``jax.distributed`` on 127.0.0.1, no model.
"""

import os
import socket
import subprocess
import sys

from tests import xla_env
from tests.data.test_criteo_reader import SPEC, numbered_lines, write

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import sys
import jax
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from embedlib.data import CriteoReader, criteo_spec
from embedlib.training import train_lib
spec = criteo_spec([100] * 13 + [2] + [1000] * 12)
own = CriteoReader(sys.argv[3], spec, batch_size=4, num_epochs=1,
                   process_index=jax.process_index(), process_count=2)
print("own", len(list(own)))
reader = CriteoReader(sys.argv[3], spec, batch_size=4, num_epochs=1,
                      process_index=jax.process_index(), process_count=2)
print("together", len(list(train_lib._while_every_process_has_one(reader))))
"""


def test_processes_with_uneven_shares_stop_together(tmp_path):
  assert SPEC.features[13].num_embeddings == 2  # the script's spec is this one
  path = write(tmp_path, numbered_lines(7))
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  env = xla_env.subprocess_env(1)
  procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, address, str(i), path], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outputs = [p.communicate(timeout=120) for p in procs]
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  counts = [[line for line in out.splitlines() if line.startswith(("own", "together"))]
            for out, _ in outputs]  # gloo writes its own lines to stdout too
  assert counts == [["own 2", "together 1"], ["own 1", "together 1"]]
