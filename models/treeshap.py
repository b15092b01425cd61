"""Exact path-dependent TreeSHAP for LightGBM and XGBoost binary models, vectorised over rows
and over all the trees of a model at once (`TreeShap`).

Why not the libraries' own `pred_contrib`: on the demo model (100 trees up to 18 deep, 413
inputs) LightGBM took 1.5-2.5 s per 1,000 rows, far from what a scoring request can wait.

The values are the libraries' (the same Shapley values of the same coalition game), computed
another way. For one tree and one row x, the game is f(S) = sum over leaves l of
v_l * prod over the distinct features j on l's path of (o_lj if j in S else z_lj), with o_lj = 1
when x takes every split on j along the path (else 0) and z_lj the product of the cover
fractions of those splits. The Shapley value of j from leaf l is then

    v_l * (o_lj - z_lj) * integral over t in [0, 1] of prod_{k != j} ((1 - t) z_lk + t o_lk) dt

(the Shapley weights |S|!(d-|S|-1)!/d! are Beta integrals). The integrand is a polynomial of
degree < the path's depth, so a Gauss-Legendre rule of ceil(depth / 2) points is exact. The
product over a path is a product over its edges (for a feature split twice on a path, the
later edge carries the ratio of the two cumulative factors), so it is shared by every leaf
below an edge: a top-down pass gives each node's product from the root, a bottom-up pass each
node's sum over its leaves, and each edge credits its feature with one dot product over the
quadrature points. Work per row is O(nodes x points), against the O(leaves x depth^2) of the
recursive algorithm, and it runs as a few numpy operations per tree depth, not per node.
"""

from __future__ import annotations

import itertools
import json
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

# Rows per block: the passes hold a few (nodes x rows x points) float64 arrays; 64 rows keep
# them near 10 MB each on a 100-tree model while amortising the per-level numpy calls.
_BLOCK_ROWS = 64
_THREADS = min(4, os.cpu_count() or 1)

_MISSING_NONE, _MISSING_ZERO, _MISSING_NAN = 0, 1, 2
_LIGHTGBM_ZERO = 1e-35  # LightGBM's kZeroThreshold: |x| at or below it is "zero" for missing_type Zero


class Unsupported(Exception):
    """The model has something this implementation does not cover (categorical splits,
    several classes, averaged or linear trees...): use the library's own TreeSHAP."""


@dataclass
class _Node:
    """One node while a tree is read (leaf when `left` is None)."""

    cover: float
    value: float = 0.0
    feature: int = -1
    threshold: float = 0.0
    default_left: bool = False
    missing: int = _MISSING_NAN
    left: _Node | None = None
    right: _Node | None = None


@dataclass(frozen=True)
class TreeShap:
    """The trees of a model flattened in depth order (all roots, then all depth-1 nodes...),
    ready to explain rows of its input matrix (`contributions`)."""

    n_features: int
    less_equal: bool
    """Split rule: x <= threshold goes left (LightGBM), else x < threshold (XGBoost)."""
    level_starts: np.ndarray
    """Node ids where each depth starts (and one past the last node)."""
    parent: np.ndarray
    is_left: np.ndarray
    left: np.ndarray
    right: np.ndarray
    """Children of internal nodes; -1 for leaves."""
    feature: np.ndarray
    threshold: np.ndarray
    default_left: np.ndarray
    missing: np.ndarray
    value: np.ndarray
    previous: np.ndarray
    """For an edge (a non-root node): the nearest edge above it on the same feature, or -1."""
    step_table: np.ndarray
    """(nodes x 3, points): the edge's factor of the path's product at each quadrature point,
    in each case: the row takes neither this split nor the earlier one on its feature (0),
    only the earlier one (1), or both (2). An edge with no earlier split on its feature is in
    case 1 or 2."""
    term_table: np.ndarray
    """(nodes x 3, points): (o - z) / factor of the edge minus that of the earlier split on its
    feature, per case (summed down a path, it telescopes to the last split's)."""
    internal_by_level: dict[int, np.ndarray]
    """Level start -> the internal nodes of that level."""
    weights: np.ndarray
    edge_order: np.ndarray
    """The edges (non-root nodes) ordered by the feature of their split..."""
    feature_starts: np.ndarray
    credited: np.ndarray
    """... where each feature's run starts in that order, and which feature it is."""

    def contributions(self, X: np.ndarray, *, threads: int = _THREADS) -> np.ndarray:
        """Shapley values (rows x features) of each feature for each row of `X` (the model's
        input matrix, missing values as NaN), summed over the trees; without the bias. Blocks
        of rows are computed `threads` at a time: the passes are numpy operations on arrays of
        millions of elements, which run outside the GIL, so a second core nearly doubles the
        rate (a fleet's newest hour is tens of thousands of rows)."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"TreeShap: expected a matrix with {self.n_features} columns, got shape {X.shape}")
        out = np.empty((len(X), self.n_features))

        def block(start: int) -> None:
            rows = X[start : start + _BLOCK_ROWS]
            values = self._edge_values(rows)[self.edge_order]
            out[start : start + len(rows)] = 0.0
            out[start : start + len(rows), self.credited] = np.add.reduceat(values, self.feature_starts, axis=0).T

        starts = range(0, len(X), _BLOCK_ROWS)
        if threads <= 1 or len(starts) <= 1:
            for start in starts:
                block(start)
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="treeshap") as pool:
                for _ in pool.map(block, starts):  # each block writes its own rows of `out`
                    pass
        return out

    def _goes_left(self, X: np.ndarray) -> np.ndarray:
        """(nodes, rows): whether each row takes the left branch at each internal node."""
        internal = self.left >= 0
        x = X[:, self.feature[internal]].T
        missing = self.missing[internal, None]
        nan = np.isnan(x)
        if self.less_equal:
            # LightGBM: NaN is 0 unless NaN is the missing value; "missing" values follow the default.
            x = np.where(nan & (missing != _MISSING_NAN), 0.0, x)
            default = ((missing == _MISSING_ZERO) & (np.abs(x) <= _LIGHTGBM_ZERO)) | ((missing == _MISSING_NAN) & nan)
            with np.errstate(invalid="ignore"):
                rule = x <= self.threshold[internal, None]
        else:
            default = nan
            with np.errstate(invalid="ignore"):
                rule = x < self.threshold[internal, None]
        go = np.zeros((len(self.left), len(X)), dtype=bool)
        go[internal] = np.where(default, self.default_left[internal, None], rule)
        return go

    def _edge_values(self, X: np.ndarray) -> np.ndarray:
        """(nodes, rows): what each edge credits its feature with, for each row."""
        n, rows = len(self.parent), len(X)
        first_edge = int(self.level_starts[1])
        go_left = self._goes_left(X)
        agree = go_left[self.parent] == self.is_left[:, None]
        # ones[c]: the row takes every split on c's feature from the root down to c. Row n
        # stands for "no earlier split on the feature": always taken.
        ones = np.ones((n + 1, rows), dtype=bool)
        for a, b in self._levels(1):
            ones[a:b] = agree[a:b] & ones[self.previous[a:b]]
        # Each edge is in one of three cases (taken or not, and the same for the earlier split
        # on its feature); its factor and its telescoped term are looked up per case.
        case = ones[:n].astype(np.intp) + ones[self.previous]
        case += np.arange(0, 3 * n, 3)[:, None]  # a row of the (nodes x 3, points) tables
        step = np.take(self.step_table, case, axis=0)
        down = np.ones((n, rows, len(self.weights)))  # product along the path from the root
        for a, b in self._levels(1):
            np.multiply(down[self.parent[a:b]], step[a:b], out=down[a:b])
        up = np.empty_like(down)  # sum over the leaves below, of value x product down to them
        up[:] = self.value[:, None, None]
        for a, _ in self._levels(0, reverse=True):
            internal = self.internal_by_level[a]
            if len(internal):
                lft, rgt = self.left[internal], self.right[internal]
                up[internal] = step[lft] * up[lft] + step[rgt] * up[rgt]
        down *= up
        down *= np.take(self.term_table, case, axis=0)
        values = down @ self.weights
        values[:first_edge] = 0.0
        return values

    def _levels(self, first: int, reverse: bool = False) -> list[tuple[int, int]]:
        bounds = list(zip(self.level_starts[first:-1].tolist(), self.level_starts[first + 1 :].tolist(), strict=True))
        return bounds[::-1] if reverse else bounds


_CACHE: weakref.WeakKeyDictionary[Any, TreeShap] = weakref.WeakKeyDictionary()


def tree_shap(classifier: Any) -> TreeShap:
    """The `TreeShap` of a fitted `LGBMClassifier` or `XGBClassifier` (built once per object
    and kept while the object lives). Raises `Unsupported` for what it does not cover."""
    name = type(classifier).__name__
    if name not in ("LGBMClassifier", "XGBClassifier"):
        raise Unsupported(f"no TreeSHAP for a {name}")
    cached = _CACHE.get(classifier)
    if cached is None:
        if name == "LGBMClassifier":
            roots, n_features, less_equal = _lightgbm_trees(classifier.booster_), classifier.n_features_in_, True
        else:
            roots, n_features, less_equal = _xgboost_trees(classifier.get_booster()), classifier.n_features_in_, False
        cached = _flatten(roots, int(n_features), less_equal)
        _CACHE[classifier] = cached
    return cached


def _lightgbm_trees(booster: Any) -> list[_Node]:
    model = booster.dump_model()
    if model.get("num_tree_per_iteration", 1) != 1 or model.get("average_output"):
        raise Unsupported("LightGBM model with several trees per iteration or averaged output")

    def read(node: dict[str, Any]) -> _Node:
        if "leaf_value" in node:
            return _Node(cover=float(node.get("leaf_count", 1)), value=float(node["leaf_value"]))
        if node.get("decision_type") != "<=":
            raise Unsupported(f"LightGBM split of type {node.get('decision_type')!r}")
        return _Node(
            cover=float(node["internal_count"]),
            feature=int(node["split_feature"]),
            threshold=float(node["threshold"]),
            default_left=bool(node["default_left"]),
            missing={"None": _MISSING_NONE, "Zero": _MISSING_ZERO, "NaN": _MISSING_NAN}[node["missing_type"]],
            left=read(node["left_child"]),
            right=read(node["right_child"]),
        )

    trees = []
    for tree in model["tree_info"]:
        if tree.get("num_cat", 0) or "leaf_coeff" in tree["tree_structure"]:
            raise Unsupported("LightGBM tree with categorical splits or linear leaves")
        trees.append(read(tree["tree_structure"]))
    return trees


def _xgboost_trees(booster: Any) -> list[_Node]:
    learner = json.loads(booster.save_raw(raw_format="json"))["learner"]
    gbm = learner["gradient_booster"]
    if gbm["name"] != "gbtree" or int(learner["learner_model_param"].get("num_class", "0")) > 1:
        raise Unsupported(
            f"XGBoost booster {gbm['name']!r} with {learner['learner_model_param'].get('num_class')} classes"
        )
    trees = []
    for t in gbm["model"]["trees"]:
        if any(t["split_type"]) or int(t["tree_param"].get("size_leaf_vector", "1")) > 1:
            raise Unsupported("XGBoost tree with categorical splits or vector leaves")
        left, right = t["left_children"], t["right_children"]

        def read(i: int, t: dict[str, Any] = t, left: list[int] = left, right: list[int] = right) -> _Node:
            if left[i] < 0:
                # A leaf keeps its value where an internal node keeps its split condition.
                return _Node(cover=float(t["sum_hessian"][i]), value=float(t["split_conditions"][i]))
            return _Node(
                cover=float(t["sum_hessian"][i]),
                feature=int(t["split_indices"][i]),
                # XGBoost compares in float32: the threshold as float32 decides like it does.
                threshold=float(np.float32(t["split_conditions"][i])),
                default_left=bool(t["default_left"][i]),
                left=read(left[i]),
                right=read(right[i]),
            )

        trees.append(read(0))
    return trees


def _flatten(roots: list[_Node], n_features: int, less_equal: bool) -> TreeShap:
    """Number the nodes of all trees level by level and precompute each edge's factors."""
    order: list[_Node] = []
    parent: list[int] = []
    previous: list[int] = []
    cumulative: list[float] = []  # product of cover fractions over the splits on the edge's feature so far
    depth_starts = [0]
    level: list[tuple[_Node, int, dict[int, int]]] = [(r, -1, {}) for r in roots]
    while level:
        following = []
        for node, above, last_on in level:
            me = len(order)
            order.append(node)
            parent.append(above)
            if above >= 0:
                split = order[above]
                before = last_on.get(split.feature, -1)
                if split.cover <= 0 or node.cover <= 0:
                    raise Unsupported("a split with zero cover")
                fraction = node.cover / split.cover
                previous.append(before)
                cumulative.append(fraction * (cumulative[before] if before >= 0 else 1.0))
                last_on = {**last_on, split.feature: me}
            else:
                previous.append(-1)
                cumulative.append(1.0)
            if node.left is not None and node.right is not None:
                following += [(node.left, me, last_on), (node.right, me, last_on)]
        depth_starts.append(len(order))
        level = following
    n = len(order)
    max_depth = len(depth_starts) - 2
    points, weights = np.polynomial.legendre.leggauss(max(1, (max_depth + 1) // 2))
    t = (points + 1) / 2  # from [-1, 1] to [0, 1]
    par = np.asarray(parent)
    prev = np.asarray(previous)
    z = np.asarray(cumulative)[:, None]
    # factor(o) = (1 - t) z + t o, term(o) = (o - z) / factor(o); for "no earlier split": 1 and 0.
    has_prev = (prev >= 0)[:, None]
    zp = np.where(has_prev, np.asarray(cumulative)[prev][:, None], 1.0)
    f0, f1 = (1 - t) * z, (1 - t) * z + t
    p0, p1 = np.where(has_prev, (1 - t) * zp, 1.0), np.where(has_prev, (1 - t) * zp + t, 1.0)
    t0, t1 = -z / f0, (1 - z) / f1
    q0, q1 = np.where(has_prev, -zp / p0, 0.0), np.where(has_prev, (1 - zp) / p1, 0.0)
    is_root = par < 0
    step_table = np.where(is_root[:, None, None], 1.0, np.stack([f0 / p0, f0 / p1, f1 / p1], axis=1)).reshape(3 * n, -1)
    term_table = np.where(is_root[:, None, None], 0.0, np.stack([t0 - q0, t0 - q1, t1 - q1], axis=1)).reshape(3 * n, -1)
    idx = np.arange(n)
    left = np.full(n, -1)
    right = np.full(n, -1)
    child = idx[~is_root]
    is_left = np.zeros(n, dtype=bool)
    # Children were appended left then right, so the first child of each parent is its left.
    is_first = np.ones(len(child), dtype=bool)
    is_first[1:] = par[child][1:] != par[child][:-1]
    is_left[child[is_first]] = True
    left[par[child[is_first]]] = child[is_first]
    right[par[child[~is_first]]] = child[~is_first]
    feature = np.array([node.feature for node in order])
    edge_feature = np.where(is_root, 0, feature[np.maximum(par, 0)])
    edge_order = child[np.argsort(edge_feature[child], kind="stable")]
    credited, feature_starts = np.unique(edge_feature[edge_order], return_index=True)
    internal_by_level = {a: idx[a:b][left[a:b] >= 0] for a, b in itertools.pairwise(depth_starts)}
    return TreeShap(
        n_features=n_features,
        less_equal=less_equal,
        level_starts=np.asarray(depth_starts),
        parent=np.where(par >= 0, par, 0),
        is_left=is_left,
        left=left,
        right=right,
        feature=np.maximum(feature, 0),
        threshold=np.array([node.threshold for node in order]),
        default_left=np.array([node.default_left for node in order]),
        missing=np.array([node.missing for node in order]),
        value=np.array([node.value if node.left is None else 0.0 for node in order]),
        previous=np.where(prev >= 0, prev, n),
        step_table=step_table,
        term_table=term_table,
        internal_by_level=internal_by_level,
        weights=weights / 2,
        edge_order=edge_order,
        feature_starts=feature_starts,
        credited=credited,
    )
