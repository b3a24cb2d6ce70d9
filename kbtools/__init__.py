"""kb-pipeline's development tools: `kb dev` (devstack), `kb demo` (demo) and `kb chaos`
(chaos). They use the product in ``services`` and ship beside it; nothing in ``services``
imports them: `kb` names their command modules and imports one only when it runs."""
