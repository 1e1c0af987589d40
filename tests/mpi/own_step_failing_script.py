"""A model's own train_step that raises on one rank mid-run (the others wait in its
optimizer's sum): every rank must stop, quickly, with the error named once."""

import os
import sys

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [TESTS, os.path.join(TESTS, "loop")]   # the models, and conftest they use

import hyparflow as hf  # noqa: E402

from test_own_steps import GAN, gan, gan_data  # noqa: E402

FAIL_RANK, FAIL_STEP = int(sys.argv[1]), int(sys.argv[2])


class Fails(GAN):
    calls = 0

    def train_step(self, data):
        Fails.calls += 1   # eager: Python runs every step
        if hf.rank() == FAIL_RANK and Fails.calls > FAIL_STEP:
            raise RuntimeError("injected failure in the own train_step")
        return super().train_step(data)


model = gan()
model.__class__ = Fails
hf.fit(model, gan_data(), batch_size=16, epochs=3, num_stages=1, num_microbatches=1,
       verbose=0, run_eagerly=True)
print("finished without the failure", flush=True)
