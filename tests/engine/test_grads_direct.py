"""Sums no other rank shares (`Gradients.direct`): a variable's only gradient of the step
goes to the optimizer as the tensor it came as, a second one is added in its buffer."""

import keras
import numpy as np
import tensorflow as tf

from hyparflow.engine.grads import Gradients


def test_the_only_gradient_is_not_copied_and_a_second_is_summed():
    variables = [keras.Variable(np.zeros((3, 2), "float32")),
                 keras.Variable(np.zeros(4, "float32"))]
    grads = Gradients(variables, eager=True)
    grads.make_buffers()
    grads.direct = True
    only = tf.ones((3, 2))
    grads.hold(0, only)
    assert grads._held[0] is only and not np.any(grads.views[0])   # no copy made
    grads.hold(1, tf.ones(4))
    grads.hold(1, 2 * tf.ones(4))   # a second microbatch: summed in the buffer
    np.testing.assert_array_equal(grads.views[1], 3.0)
    assert 1 not in grads._held
    grads.apply_local(keras.optimizers.SGD(1.0))
    np.testing.assert_array_equal(variables[0].numpy(), -1.0)
    np.testing.assert_array_equal(variables[1].numpy(), -3.0)
    assert not grads._held and not grads.touched.any()


def test_shared_sums_copy_into_their_buffers():
    variables = [keras.Variable(np.zeros(5, "float32"))]
    grads = Gradients(variables, eager=True)
    grads.make_buffers()
    grads.hold(0, tf.fill([5], 2.0))   # not direct: into the buffer an allreduce sends
    assert not grads._held
    np.testing.assert_array_equal(grads.flat_grads([0])[:5], 2.0)
