"""Public Keras examples users copy (keras.io), shrunk: the same layers, losses and input
dtypes at small sizes, on synthetic data of the same shapes; no downloads. Each builder
sets the seed and returns `(model, x, y)`; Adam throughout. Dropout rates are 0: a
dropout mask under hyparflow is drawn per microbatch (docs/models.md, "Dropout"), not
as model.fit draws it, so weights compare only without it. docs/models.md lists what
each one gave ("Public Keras examples")."""

import keras
import numpy as np
from keras import ops

L = keras.layers
N = 64  # samples: 4 batches of 16


def _adam(model, loss, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, **kwargs)
    return model


# -- structured data -------------------------------------------------------------------

class Classifier(L.Layer):
    """structured_data_classification_from_scratch: one layer over the dict of encoded
    features (concatenated), two Dense."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense_1 = L.Dense(8, activation="relu")
        self.dropout = L.Dropout(0.0)
        self.dense_2 = L.Dense(1, activation="sigmoid")

    def call(self, inputs):
        return self.dense_2(self.dropout(self.dense_1(L.concatenate(list(inputs.values())))))

    def build(self, input_shape):
        self.built = True


NUMERIC = ["age", "trestbps", "thalach", "oldpeak", "slope", "chol"]
CATEGORIES = {"sex": 2, "cp": 4, "fbs": 2, "restecg": 3, "exang": 2, "ca": 4, "thal": 3}


def structured_from_scratch():
    """Float features through adapted Normalization layers, categorical ones as int64
    multi-hot vectors (the example encodes them with Integer/StringLookup in tf.data)."""
    keras.utils.set_random_seed(30)
    rng = np.random.default_rng(30)
    x = {name: (rng.normal(size=(N, 1)) * 10 + 50).astype("float32") for name in NUMERIC}
    x.update({name: np.eye(k, dtype="int64")[rng.integers(0, k, N)]
              for name, k in CATEGORIES.items()})
    inputs, encoded = {}, {}
    for name in NUMERIC:
        inputs[name] = keras.Input((1,), name=name, dtype="float32")
        norm = L.Normalization()
        norm.adapt(x[name])
        encoded[name] = norm(inputs[name])
    for name, k in CATEGORIES.items():
        inputs[name] = encoded[name] = keras.Input((k,), name=name, dtype="int64")
    model = keras.Model(inputs, Classifier()(encoded))
    return _adam(model, "binary_crossentropy", metrics=["accuracy"]), x, \
        rng.integers(0, 2, (N, 1)).astype("float32")


def structured_string_lookup():
    """The preprocessing guide's way: string and integer columns turned into one-hot ids
    by StringLookup / IntegerLookup inside the model (numpy object arrays in fit)."""
    keras.utils.set_random_seed(31)
    rng = np.random.default_rng(31)
    thal = np.array(["fixed", "normal", "reversible"], dtype=object)[rng.integers(0, 3, (N, 1))]
    import tensorflow as tf

    # Strings as tensors: Keras 3.15's model.fit refuses numpy string and object arrays
    # ("Invalid dtype: object"); the example feeds a tf.data set of them.
    x = {"thal": tf.constant(thal.astype(str)), "ca": rng.integers(0, 4, (N, 1)).astype("int64"),
         "age": rng.normal(size=(N, 1)).astype("float32")}
    a = keras.Input((1,), name="thal", dtype="string")
    b = keras.Input((1,), name="ca", dtype="int64")
    c = keras.Input((1,), name="age", dtype="float32")
    s = L.StringLookup(vocabulary=["fixed", "normal", "reversible"], output_mode="one_hot")(a)
    i = L.IntegerLookup(vocabulary=[0, 1, 2, 3], output_mode="one_hot")(b)
    h = L.Dense(8, activation="relu")(L.concatenate([s, i, c]))
    model = keras.Model({"thal": a, "ca": b, "age": c}, L.Dense(1, activation="sigmoid")(h))
    return _adam(model, "binary_crossentropy"), x, rng.integers(0, 2, (N, 1)).astype("float32")


_FEATURES = {}


def _feature_space():
    """structured_data_classification_with_feature_space: a FeatureSpace over float,
    integer and string columns and a crossed pair, adapted on a tf.data set; the model
    is trained on its concatenated output (as the example maps its dataset). Adapted
    once: the result is the same every time."""
    if not _FEATURES:
        import tensorflow as tf
        from keras.utils import FeatureSpace

        rng = np.random.default_rng(32)
        raw = {"age": rng.normal(50, 10, N).astype("float32"),
               "chol": rng.normal(240, 40, N).astype("float32"),
               "sex": rng.integers(0, 2, N).astype("int64"),
               "cp": rng.integers(0, 4, N).astype("int64"),
               "thal": np.array(["fixed", "normal", "reversible"])[rng.integers(0, 3, N)]}
        space = FeatureSpace(
            features={"age": FeatureSpace.float_normalized(),
                      "chol": FeatureSpace.float_normalized(),
                      "sex": FeatureSpace.integer_categorical(num_oov_indices=0),
                      "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
                      "thal": FeatureSpace.string_categorical(num_oov_indices=0)},
            crosses=[FeatureSpace.cross(("sex", "cp"), crossing_dim=8)],
            output_mode="concat")
        space.adapt(tf.data.Dataset.from_tensor_slices(raw).batch(16))
        _FEATURES["x"] = np.asarray(space(raw)).astype("float32")
        _FEATURES["y"] = rng.integers(0, 2, (N, 1)).astype("float32")
    return _FEATURES["x"], _FEATURES["y"]


def feature_space():
    x, y = _feature_space()
    keras.utils.set_random_seed(32)
    encoded = keras.Input((x.shape[1],))
    h = L.Dropout(0.0)(L.Dense(8, activation="relu")(encoded))
    model = keras.Model(encoded, L.Dense(1, activation="sigmoid")(h))
    return _adam(model, "binary_crossentropy", metrics=["accuracy"]), x, y


# -- text --------------------------------------------------------------------------------

VOCAB, LENGTH = 50, 24


def _tokens(seed, dtype="int64"):
    rng = np.random.default_rng(seed)
    return rng.integers(1, VOCAB, (N, LENGTH)).astype(dtype), rng.integers(0, 2, (N, 1))


def text_from_scratch():
    """text_classification_from_scratch: TextVectorization in the tf.data pipeline, the
    model on int64 ids: Embedding, two strided Conv1D, global max pooling."""
    keras.utils.set_random_seed(33)
    inputs = keras.Input((None,), dtype="int64")
    h = L.Dropout(0.0)(L.Embedding(VOCAB, 8)(inputs))
    h = L.Conv1D(8, 3, padding="valid", activation="relu", strides=2)(h)
    h = L.Conv1D(8, 3, padding="valid", activation="relu", strides=2)(h)
    h = L.Dropout(0.0)(L.Dense(8, activation="relu")(L.GlobalMaxPooling1D()(h)))
    model = keras.Model(inputs, L.Dense(1, activation="sigmoid", name="predictions")(h))
    x, y = _tokens(33)
    return _adam(model, "binary_crossentropy", metrics=["accuracy"]), x, y.astype("float32")


def text_end_to_end():
    """The same example's end-to-end model: TextVectorization inside, on raw strings."""
    keras.utils.set_random_seed(34)
    rng = np.random.default_rng(34)
    words = np.array(["good", "bad", "film", "plot", "actor", "boring", "great", "the"])
    x = np.array([" ".join(words[rng.integers(0, 8, 6)]) for _ in range(N)], dtype=object)
    vectorize = L.TextVectorization(max_tokens=VOCAB, output_mode="int", output_sequence_length=8)
    vectorize.adapt(x)
    inputs = keras.Input((1,), dtype="string")
    h = L.GlobalAveragePooling1D()(L.Embedding(VOCAB, 8)(vectorize(inputs)))
    model = keras.Model(inputs, L.Dense(1, activation="sigmoid")(h))
    import tensorflow as tf

    return _adam(model, "binary_crossentropy"), tf.constant(x[:, None].astype(str)), \
        rng.integers(0, 2, (N, 1)).astype("float32")


class TransformerBlock(L.Layer):
    """text_classification_with_transformer's block: attention and a feed-forward net,
    each added back and normalised (LayerNormalization, epsilon 1e-6)."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.att = L.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([L.Dense(ff_dim, activation="relu"), L.Dense(embed_dim)])
        self.layernorm1 = L.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = L.LayerNormalization(epsilon=1e-6)
        self.dropout1, self.dropout2 = L.Dropout(rate), L.Dropout(rate)

    def call(self, inputs):
        out1 = self.layernorm1(inputs + self.dropout1(self.att(inputs, inputs)))
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1)))


class TokenAndPositionEmbedding(L.Layer):
    """Token embeddings plus position embeddings (one per position, no batch axis)."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = L.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = L.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(0, ops.shape(x)[-1], 1))
        return self.token_emb(x) + positions


def transformer_text():
    """Input((maxlen,)) of the default float32 dtype holding the token ids, as written."""
    keras.utils.set_random_seed(35)
    inputs = keras.Input((LENGTH,))
    h = TokenAndPositionEmbedding(LENGTH, VOCAB, 8)(inputs)
    h = TransformerBlock(8, 2, 8)(h)
    h = L.Dropout(0.0)(L.GlobalAveragePooling1D()(h))
    h = L.Dropout(0.0)(L.Dense(8, activation="relu")(h))
    model = keras.Model(inputs, L.Dense(2, activation="softmax")(h))
    x, y = _tokens(35, "float32")
    return _adam(model, "sparse_categorical_crossentropy", metrics=["accuracy"]), x, y[:, 0]


def bidirectional_lstm():
    """bidirectional_lstm_imdb: Embedding and two Bidirectional LSTMs on int ids."""
    keras.utils.set_random_seed(36)
    inputs = keras.Input((None,), dtype="int32")
    h = L.Embedding(VOCAB, 8)(inputs)
    h = L.Bidirectional(L.LSTM(4, return_sequences=True))(h)
    h = L.Bidirectional(L.LSTM(4))(h)
    model = keras.Model(inputs, L.Dense(1, activation="sigmoid")(h))
    x, y = _tokens(36, "int32")
    return _adam(model, "binary_crossentropy", metrics=["accuracy"]), x[:, :12], y.astype(
        "float32")


# -- time series -------------------------------------------------------------------------

def weather_lstm():
    """timeseries_weather_forecasting: an LSTM over windows of 7 features, one value out."""
    keras.utils.set_random_seed(37)
    inputs = keras.Input((12, 7))
    model = keras.Model(inputs, L.Dense(1)(L.LSTM(8)(inputs)))
    rng = np.random.default_rng(37)
    return _adam(model, "mse"), rng.normal(size=(N, 12, 7)).astype("float32"), \
        rng.normal(size=(N, 1)).astype("float32")


def timeseries_conv1d():
    """timeseries_classification_from_scratch (FordA): three Conv1D, BatchNormalization,
    ReLU blocks, global average pooling, softmax."""
    keras.utils.set_random_seed(38)
    inputs = keras.Input((32, 1))
    h = inputs
    for _ in range(3):
        h = L.ReLU()(L.BatchNormalization()(L.Conv1D(8, 3, padding="same")(h)))
    model = keras.Model(inputs, L.Dense(2, activation="softmax")(L.GlobalAveragePooling1D()(h)))
    rng = np.random.default_rng(38)
    return _adam(model, "sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"]), \
        rng.normal(size=(N, 32, 1)).astype("float32"), rng.integers(0, 2, N)


# -- vision ------------------------------------------------------------------------------

def mnist_convnet():
    """mnist_convnet: two Conv2D + MaxPooling2D, Flatten, Dense softmax."""
    keras.utils.set_random_seed(39)
    inputs = keras.Input((12, 12, 1))
    h = L.MaxPooling2D(2)(L.Conv2D(4, 3, activation="relu")(inputs))
    h = L.MaxPooling2D(2)(L.Conv2D(8, 3, activation="relu")(h))
    h = L.Dropout(0.0)(L.Flatten()(h))
    model = keras.Model(inputs, L.Dense(10, activation="softmax")(h))
    rng = np.random.default_rng(39)
    return _adam(model, "categorical_crossentropy", metrics=["accuracy"]), \
        rng.random((N, 12, 12, 1)).astype("float32"), np.eye(10, dtype="float32")[
            rng.integers(0, 10, N)]


def mini_xception():
    """image_classification_from_scratch: Rescaling, separable convolutions with
    BatchNormalization, residual additions of a strided 1x1 projection (its random
    augmentation layers left out: their draws differ from model.fit's, as Dropout's)."""
    keras.utils.set_random_seed(40)
    inputs = keras.Input((16, 16, 3))
    h = L.Activation("relu")(L.BatchNormalization()(
        L.Conv2D(8, 3, strides=2, padding="same")(L.Rescaling(1.0 / 255)(inputs))))
    previous = h
    for size in (8, 16):
        h = L.Activation("relu")(h)
        h = L.BatchNormalization()(L.SeparableConv2D(size, 3, padding="same")(h))
        h = L.Activation("relu")(h)
        h = L.BatchNormalization()(L.SeparableConv2D(size, 3, padding="same")(h))
        h = L.MaxPooling2D(3, strides=2, padding="same")(h)
        h = L.add([h, L.Conv2D(size, 1, strides=2, padding="same")(previous)])
        previous = h
    h = L.GlobalAveragePooling2D()(L.Activation("relu")(h))
    model = keras.Model(inputs, L.Dense(1)(L.Dropout(0.0)(h)))
    rng = np.random.default_rng(40)
    return _adam(model, keras.losses.BinaryCrossentropy(from_logits=True)), \
        rng.integers(0, 256, (N, 16, 16, 3)).astype("float32"), \
        rng.integers(0, 2, (N, 1)).astype("float32")


# -- recommender -------------------------------------------------------------------------

class RecommenderNet(keras.Model):
    """collaborative_filtering_movielens: the score of a (user, movie) id pair is
    `ops.tensordot(user, movie, 2)`, one sum over the whole batch, plus two biases."""

    def __init__(self, num_users=12, num_movies=9, embedding_size=4, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = L.Embedding(num_users, embedding_size,
                                          embeddings_initializer="he_normal",
                                          embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.user_bias = L.Embedding(num_users, 1)
        self.movie_embedding = L.Embedding(num_movies, embedding_size,
                                           embeddings_initializer="he_normal",
                                           embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.movie_bias = L.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        x = ops.tensordot(user_vector, movie_vector, 2) + self.user_bias(inputs[:, 0]) + \
            self.movie_bias(inputs[:, 1])
        return ops.nn.sigmoid(x)


def recommender(dtype="int64"):
    """int64 id pairs as written; `dtype="float32"` casts them (Embedding casts back)."""
    keras.utils.set_random_seed(41)
    rng = np.random.default_rng(41)
    x = np.stack([rng.integers(0, 12, N), rng.integers(0, 9, N)], axis=1).astype(dtype)
    model = RecommenderNet()
    model(x[:2])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    return model, x, rng.random((N, 1)).astype("float32")


# What each is compared with: "fit" (model.fit's weights), "accumulate" (BatchNorm's
# per-microbatch statistics: model.fit on the microbatches, gradients accumulated).
RUNNABLE = {f.__name__: f for f in (
    structured_from_scratch, feature_space, text_from_scratch, transformer_text,
    bidirectional_lstm, weather_lstm, timeseries_conv1d, mnist_convnet, mini_xception)}
BATCH_NORM = {"timeseries_conv1d", "mini_xception"}
