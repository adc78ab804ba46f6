# Source this to run rollflow from a checkout without installing it (e.g. on a CUDA box whose Python
# lacks pip access):  source scripts/use_checkout.sh
# - installs any wheels found in ./.whl (megatron-core, pydantic, ... for that box's Python) into
#   /tmp/rollflow-site without touching the system site-packages;
# - maps the checkout's folders to the rollflow.* namespace the way the installed package does
#   (build/pathlink/rollflow/{flows,tasks,artifacts,infra} -> ./flows, ...), so `import rollflow.tasks...`
#   works and no module is importable under a second, top-level name.
_rf_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ls "$_rf_root"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/rollflow-site "$_rf_root"/.whl/*.whl || return 1
  export PYTHONPATH=/tmp/rollflow-site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$_rf_root/build/pathlink/rollflow"
for _rf_pkg in flows tasks artifacts infra; do
  ln -sfn "$_rf_root/$_rf_pkg" "$_rf_root/build/pathlink/rollflow/$_rf_pkg"
done
export PYTHONPATH=$_rf_root/build/pathlink:$_rf_root${PYTHONPATH:+:$PYTHONPATH}
unset _rf_root _rf_pkg
