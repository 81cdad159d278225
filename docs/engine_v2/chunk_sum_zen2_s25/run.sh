# this checkout's attend against 69ed0f6's (the worktree, with this checkout's attention.py), in turns.
# Needs: git worktree add /tmp/wt_old 69ed0f6 && cp benchmarks/attention.py /tmp/wt_old/benchmarks/
mkdir -p runs/attn_ab
for T in "82 3" "47 2"; do set -- $T
for r in 1 2 3; do
  python -m dbs_fast.benchmarks.attention --arms v2 --prefix $1 --used $2 --repeats 10 --out runs/attn_ab/this_T$1_r$r.json | grep v2
  python -c "import sys; from dbs_fast.benchmarks.checkouts import _import_from; _import_from('/tmp/wt_old'); from dbs_fast.benchmarks.attention import main; import dbs_fast.export.prefix_graph as p; assert p.__file__.startswith('/tmp/wt_old'); sys.exit(main(sys.argv[1:]))" --arms v2 --prefix $1 --used $2 --repeats 10 --out runs/attn_ab/before_T$1_r$r.json | grep v2
done; done
