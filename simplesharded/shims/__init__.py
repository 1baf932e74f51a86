"""Platform shims: what a platform needs that is neither the library's job nor torch's today
(gloo's all-gather path, the CPU ranks' malloc, the launcher's environment per device, the
fork server local ranks start from)."""
