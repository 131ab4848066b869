"""Print one line to stdout and one to stderr, then stay a moment: what torchrun's ``--tee`` must pass on.

Returns where torchrun put this rank's files (its ``TORCHELASTIC_ERROR_FILE`` sits in the same folder as the
stdout.log and stderr.log that ``--tee`` tails), so a test can see which log directory the job used.
"""
import os
import sys
import time


def main(ctx, text: str = "hello", linger_s: float = 2.0):
    print(f"{text} on stdout from rank {ctx.rank}", flush=True)
    print(f"{text} on stderr from rank {ctx.rank}", file=sys.stderr, flush=True)
    time.sleep(linger_s)  # torchrun tails the files every 0.1 s: let it pass the lines on before the job ends
    return {"error_file": os.environ.get("TORCHELASTIC_ERROR_FILE", "")}
