r"""Our losses as tunix policy losses, and our log-prob pass in place of tunix's.

``GRPOConfig(policy_loss_fn="grpo_kernels_fused")`` after ``import
grpo_kernels.integrations.tunix``, which registers two policy losses in tunix's registry
(``tunix.rl.function_registry.register_policy_loss_fn``), both with tunix's call
``(model, train_example, algo_config, pad_id, eos_id, **kwargs)``:

- ``"grpo_kernels"``: the completion's logits through :func:`grpo_kernels.grpo_loss`
  (``impl="auto"``), formed from the model's hidden states at the completion's positions
  only, where the model can be read (:func:`logits_policy_loss`);
- ``"grpo_kernels_fused"``: the model's final hidden states and its head through
  :func:`grpo_kernels.grpo_loss_from_hidden` (or a ``compute_final_logits`` head a chunk at a
  time), so the actor update holds no ``[B, T, V]`` array (:func:`fused_policy_loss`).

Both compute tunix's ``grpo_loss_fn`` on the same inputs and return what the installed
tunix's losses return, on tunix 0.1.7 and on its development head alike, chosen by what the
installed tunix offers, never by its version (:mod:`.offers`). :func:`patch_log_probs` puts
our log-prob pass in place of tunix's for every caller. docs/integrations/tunix.md lists every
difference.

The package, by responsibility: :mod:`.offers` (what the installed tunix has),
:mod:`.config` (its ``GRPOConfig`` read into ours), :mod:`.inputs` (a ``TrainExample``,
packed or not), :mod:`.models` (reading a model below its logits), :mod:`.placement` (its
mesh), :mod:`.losses` (the two losses and their registration), :mod:`.outputs` (what they
return), :mod:`.log_probs` (the patch), :mod:`.sampler` (the rollout's top-k and top-p carried
to both: :func:`follow_sampler`). tunix is imported by the functions that need it
(``pip install grpo-kernels[tunix]``).
"""

from grpo_kernels.integrations.tunix.config import loss_config
from grpo_kernels.integrations.tunix.inputs import (Example, example_inputs, model_inputs,
                                                    token_inputs)
from grpo_kernels.integrations.tunix.log_probs import (log_probs_function, log_probs_patched,
                                                       patch_log_probs, unpatch_log_probs)
from grpo_kernels.integrations.tunix.losses import (POLICY_LOSSES, fused_options,  # noqa: F401
                                                    fused_policy_loss, logits_options,
                                                    logits_policy_loss, register)
from grpo_kernels.integrations.tunix.outputs import differentiated, loss_output, tunix_aux
from grpo_kernels.integrations.tunix.placement import context_mesh, placement
from grpo_kernels.integrations.tunix.sampler import follow_sampler, sampler_truncation

__all__ = ["Example", "context_mesh", "differentiated", "example_inputs", "follow_sampler",
           "fused_options", "fused_policy_loss", "log_probs_function", "log_probs_patched",
           "logits_options", "logits_policy_loss", "loss_config", "loss_output", "model_inputs",
           "patch_log_probs", "placement", "register", "sampler_truncation", "token_inputs",
           "tunix_aux", "unpatch_log_probs"]

register()
