"""Conv2D, split by filters (output channels), gathered on the channel axis."""

import keras

from .split import SplitKind, common_why_not, output_split_call

__all__ = ["Filters"]


class Filters(SplitKind):
    name = "filters"
    what = "Conv2D"

    def claims(self, op):
        return isinstance(op, keras.layers.Conv2D)

    def why_not(self, op, num_tensor):
        reason = common_why_not(op, [op])
        if reason is not None:
            return reason
        if op.groups != 1 or op.data_format != "channels_last":
            return "only channels_last Conv2D with groups=1 can be split"
        if op.filters < num_tensor:
            return f"it has fewer filters ({op.filters}) than tensor ranks"
        return None

    def size(self, op):
        return int(op.kernel.shape[-1])

    def cuts(self, shard):
        op = shard.op
        return [(op.kernel, -1)] + ([(op.bias, 0)] if op.use_bias else [])

    def call(self, shard, x):
        return output_split_call(shard, x, shard.op.convolution_op)

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        forward = network.exchange(out_bytes / num_tensor, num_tensor) if split.gather else 0.0
        return forward, network.exchange(in_bytes, num_tensor)
