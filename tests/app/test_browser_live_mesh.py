"""The Live page's mesh drawn by Chromium at the page's two widths, from 4 ranks to 64: every rank
labelled in type a person reads, no marker drawn over another, never a sliver.

The figure is the one the Live page draws (:func:`~meshpact.app.figures.live_mesh_figure`), put in
a box as wide as the page's main column at 1,400 x 900 and at 1,024 x 768 with the sidebar open
(940 and 564 px), so a 64-rank ring, which the page's own runs (at most 8 ranks) never reach, is
checked without starting 64 processes; the figure in the page itself is checked
by the live browser test at both widths.
"""

from __future__ import annotations

import json

import plotly.io as pio
import pytest
from plotly.offline import get_plotlyjs

from meshpact.app.figures import LIVE_LABEL_PX, live_mesh_figure
from meshpact.app.replay import local_mesh
from meshpact.app.serve import MESH_READABLE_JS

pytestmark = [pytest.mark.browser]

MAIN_COLUMN_PX = {(1400, 900): 940, (1024, 768): 564}  # the Live page's main column, sidebar open


@pytest.fixture(scope="module")
def plotly_page(browser):
    pg = browser.new_page()
    pg.set_content(f"<html><body><script>{get_plotlyjs()}</script><div id='box'></div></body></html>")
    yield pg
    pg.close()


@pytest.mark.parametrize("viewport", list(MAIN_COLUMN_PX))
@pytest.mark.parametrize("ranks", [4, 64])
def test_the_live_mesh_is_readable_at_every_size_and_width(plotly_page, viewport, ranks):
    pg = plotly_page
    pg.set_viewport_size({"width": viewport[0], "height": viewport[1]})
    fig = json.loads(pio.to_json(live_mesh_figure(local_mesh(ranks), [1])))
    pg.evaluate(
        """([w, fig]) => { const box = document.getElementById('box'); box.innerHTML = '';
        box.style.width = w + 'px'; const d = document.createElement('div'); box.appendChild(d);
        return Plotly.newPlot(d, fig.data, fig.layout, {staticPlot: false}); }""",
        [MAIN_COLUMN_PX[viewport], fig],
    )
    seen = pg.evaluate(MESH_READABLE_JS, "#box")
    assert seen is not None and seen["width"] >= 300, seen
    labels = dict(seen["labels"])
    assert set(labels) == {str(r) for r in range(ranks) if r != 1}, labels  # the failed rank is a cross
    assert min(labels.values()) >= LIVE_LABEL_PX, labels
    assert seen["overlaps"] == 0, seen
