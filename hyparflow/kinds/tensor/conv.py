"""Conv2D, split by filters (output channels), gathered on the channel axis."""

import keras

from .split import ByOutputs, common_why_not

__all__ = ["Filters"]


class Filters(ByOutputs):
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

    def product(self, op):
        return op.convolution_op
