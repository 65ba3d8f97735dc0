"""The papers' analyses as library functions (each one backs a ``repgeom`` command).

* :mod:`.ppl_bins`      perplexity vs token dispersion, Algorithm 1 binning (paper A §2.1–2.2)
* :mod:`.knn_keys`      kNN-LM key candidates ranked by dispersion (paper A Table 1, docs/metrics.md#knn-lm-keys)
* :mod:`.knnlm`         a real kNN-LM (faiss datastore, interpolation) to check the recommended key
* :mod:`.condensation`  per-layer cosine histograms and the depth trend (paper C Fig. 2, docs/metrics.md#condensation)
* :mod:`.clusters`      contexts sharing an n-gram continuation: within/between-cluster distances (paper A §2.3)
* :mod:`.perturb`       prompt entropy and dispersion under repetition, random tokens, length (paper B §5)
* :mod:`.html_report`   one offline HTML page from the JSON outputs of every command

Shared pieces: :mod:`.corpus` (documents → token chunks), :mod:`.forward` (token batches through hooks, one pass),
:mod:`.output` (the JSON envelope every analysis writes, with its ``kind``), :mod:`.plots`.
"""
