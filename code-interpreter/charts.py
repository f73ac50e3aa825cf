"""Charts as data: what the code interpreter's kernels add to a matplotlib figure's display
bundle under the MIME type `e2b/chart`, which the SDKs read into `result.chart` (their
`LineChart`, `ScatterChart`, `BarChart`, `PieChart`, `BoxAndWhiskerChart` and `SuperChart`),
so an agent can draw the chart itself or reason over its numbers instead of a picture.

Loaded into every Python kernel by the server (`register(get_ipython())`), before any user
code, without importing matplotlib: the formatter looks for a figure's type only once
matplotlib is loaded, and the hook that remembers box plots' statistics is installed when matplotlib itself is
first imported. What a figure holds decides its type:
- pie wedges: `pie` (each wedge's label, angle in degrees, radius);
- bars (a `BarContainer`): `bar` (each bar's tick label, its container's label as group,
  height as value);
- a box plot (the statistics `Axes.bxp` drew, remembered on the axes): `box_and_whisker`;
- lines: `line`, scattered points: `scatter` (each series' label and points, with the axes'
  ticks, tick labels and scale, dates as ISO 8601);
- several axes: `superchart` of each one's chart;
anything else: `unknown`, with the title only.
"""

import datetime
import importlib.abc
import importlib.machinery
import sys

MIME = "e2b/chart"
# Attribute on an Axes holding the box statistics `bxp` drew there.
BOXES = "_e2b_box_stats"


def _number(value):
    """A JSON-safe scalar: numbers as float, dates as ISO 8601, others as text."""
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (int, float)):
        return float(value)
    return str(value)


def _scale(axis, scale):
    from matplotlib import category, dates

    converter = axis.get_converter() if hasattr(axis, "get_converter") else axis.converter
    if isinstance(converter, (dates.DateConverter, dates.ConciseDateConverter, dates._SwitchableDateConverter)):
        return "datetime"
    if isinstance(converter, category.StrCategoryConverter):
        return "categorical"
    return scale


def _axis_values(axis, scale, values):
    """Values along an axis as the user gave them: dates back from matplotlib's day numbers."""
    if scale == "datetime":
        from matplotlib import dates

        return [dates.num2date(v).isoformat() if isinstance(v, float) else _number(v) for v in values]
    return [_number(v) for v in values]


def _labels(ax):
    return {
        "title": ax.get_title() or None,
        "x_label": ax.get_xlabel() or None,
        "y_label": ax.get_ylabel() or None,
        "x_unit": None,
        "y_unit": None,
    }


def _tick(value):
    """A tick's position without the float noise of its arithmetic (1.2000000000000002)."""
    return round(float(value), 10)


def _ticks(ax):
    x_scale = _scale(ax.xaxis, ax.get_xscale())
    y_scale = _scale(ax.yaxis, ax.get_yscale())
    return {
        "x_ticks": _axis_values(ax.xaxis, x_scale, [_tick(t) for t in ax.get_xticks()]),
        "x_tick_labels": [t.get_text() for t in ax.get_xticklabels()],
        "x_scale": x_scale,
        "y_ticks": _axis_values(ax.yaxis, y_scale, [_tick(t) for t in ax.get_yticks()]),
        "y_tick_labels": [t.get_text() for t in ax.get_yticklabels()],
        "y_scale": y_scale,
    }


def _series_label(artist, index):
    label = artist.get_label()
    return label if label and not label.startswith("_") else f"series {index}"


def _pie(ax, wedges):
    return {
        "type": "pie",
        "title": ax.get_title() or None,
        "elements": [
            {"label": w.get_label(), "angle": float(w.theta2 - w.theta1), "radius": float(w.r)} for w in wedges
        ],
    }


def _bars(ax, containers):
    ticks = {round(float(t), 6): label.get_text() for t, label in zip(ax.get_xticks(), ax.get_xticklabels())}
    elements = []
    for index, container in enumerate(containers):
        group = _series_label(container, index)
        for bar in container:
            centre = round(float(bar.get_x() + bar.get_width() / 2), 6)
            elements.append({"label": ticks.get(centre, str(centre)), "group": group, "value": float(bar.get_height())})
    return {"type": "bar", **_labels(ax), "elements": elements}


def _boxes(ax, stats):
    elements = []
    for index, box in enumerate(stats):
        elements.append(
            {
                "label": str(box.get("label", index + 1)),
                "min": float(box["whislo"]),
                "first_quartile": float(box["q1"]),
                "median": float(box["med"]),
                "third_quartile": float(box["q3"]),
                "max": float(box["whishi"]),
                "outliers": [float(f) for f in box.get("fliers", [])],
            }
        )
    return {"type": "box_and_whisker", **_labels(ax), "elements": elements}


def _points(ax, kind, series):
    x_scale = _scale(ax.xaxis, ax.get_xscale())
    y_scale = _scale(ax.yaxis, ax.get_yscale())
    elements = []
    for index, (artist, xs, ys) in enumerate(series):
        points = list(zip(_axis_values(ax.xaxis, x_scale, xs), _axis_values(ax.yaxis, y_scale, ys)))
        elements.append({"label": _series_label(artist, index), "points": points})
    return {"type": kind, **_labels(ax), **_ticks(ax), "elements": elements}


def chart_of_axes(ax):
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    stats = getattr(ax, BOXES, None)
    if stats:
        return _boxes(ax, stats)
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        return _pie(ax, wedges)
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        return _bars(ax, bars)
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) > 0]
    if lines:
        return _points(ax, "line", [(line, list(line.get_xdata()), list(line.get_ydata())) for line in lines])
    scattered = [c for c in ax.collections if isinstance(c, PathCollection) and len(c.get_offsets()) > 0]
    if scattered:
        series = []
        for collection in scattered:
            offsets = collection.get_offsets()
            series.append((collection, [float(x) for x in offsets[:, 0]], [float(y) for y in offsets[:, 1]]))
        return _points(ax, "scatter", series)
    return {"type": "unknown", "title": ax.get_title() or None, "elements": []}


def chart_of_figure(figure):
    """The `e2b/chart` of a figure, or None when it has no axes (or cannot be read)."""
    try:
        axes = [ax for ax in figure.get_axes() if ax.get_visible()]
        if not axes:
            return None
        # Tick labels exist only once the figure is laid out.
        figure.draw_without_rendering()
        if len(axes) == 1:
            return chart_of_axes(axes[0])
        title = figure._suptitle.get_text() if figure._suptitle is not None else None
        return {"type": "superchart", "title": title or None, "elements": [chart_of_axes(ax) for ax in axes]}
    except Exception:  # A chart is a bonus over the PNG: never fail a display for it.
        return None


def _remember_boxes(axes_class):
    """Wraps `Axes.bxp`, which every box plot draws through, to keep its statistics."""
    drawn = axes_class.bxp
    if getattr(drawn, "_e2b", False):
        return

    def bxp(self, bxpstats, *args, **kwargs):
        result = drawn(self, bxpstats, *args, **kwargs)
        getattr(self, BOXES, None) is None and setattr(self, BOXES, [])
        getattr(self, BOXES).extend(dict(s) for s in bxpstats)
        return result

    bxp._e2b = True
    axes_class.bxp = bxp


class _WhenMatplotlibLoads(importlib.abc.MetaPathFinder):
    """Installs the box-plot hook the moment `matplotlib.axes._axes` is imported, so the
    kernel's start pays nothing for matplotlib."""

    TARGET = "matplotlib.axes._axes"

    def find_spec(self, name, path, target=None):
        if name != self.TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _remember_boxes(module.Axes)

        spec.loader.exec_module = exec_module
        return spec


def register(shell):
    """Adds the `e2b/chart` formatter to an IPython shell's display formatter."""
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class ChartFormatter(BaseFormatter):
        """Describes matplotlib figures. It answers by its own check rather than a printer
        registered for `Figure`: the inline backend, when it sets itself up (at the first
        import of pyplot), removes every formatter's printer for `Figure`."""

        format_type = Unicode(MIME)
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            figures = sys.modules.get("matplotlib.figure")
            if not self.enabled or figures is None or not isinstance(obj, figures.Figure):
                return None
            return chart_of_figure(obj)

    shell.display_formatter.formatters[MIME] = ChartFormatter(parent=shell.display_formatter)
    # The types a display computes were fixed when the shell started.
    if MIME not in shell.display_formatter.active_types:
        shell.display_formatter.active_types.append(MIME)
    if "matplotlib.axes._axes" in sys.modules:
        _remember_boxes(sys.modules["matplotlib.axes._axes"].Axes)
    else:
        sys.meta_path.insert(0, _WhenMatplotlibLoads())
