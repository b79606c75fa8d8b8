"""The experiment harness shared by the reproduction scripts in ``benchmarks/``.

One module per concept: :mod:`.data` (data sources), :mod:`.models` (Flax
models and their constraint declarations), :mod:`.train` (every seed of a
method trained at once: ``vmap`` over seeds, ``lax.scan`` over minibatches and
epochs), :mod:`.report` (results JSON, tables, plots, progress) and :mod:`.cli`
(the flags every script shares). For language models: :mod:`.text` (corpora,
vocabulary, the token stream in windows), :mod:`.transformer` (the Flax
transformer), :mod:`.lm` (its training loop over windows in order) and
:mod:`.perplexity` (its results). A script declares only its protocol: data,
model, methods, schedule and what to report.

For convolutional models: :mod:`.vision` (Flax CNN and ResNets with BatchNorm),
:mod:`.images` (image data sets, standardisation, augmentation),
:mod:`.schedules` (step decay by epochs) and :mod:`.stepwise` (one seed at a
time, one jitted call per minibatch, with ``batch_stats``: what XLA's CPU
convolutions need).

For samplers: :mod:`.posterior` (chains of a stochastic-gradient sampler or an optimizer, every
member at once, the posterior predictive averaged over thinned samples, and its accuracy, NLL and
calibration error).
"""
