/* Draws the charts of a unigate bench HTML report from the specs embedded in #unigate-charts (see
 * bench/report_html.py), with bench/static/charts.js; redraws them at the new width when the window is resized. */
(function () {
  'use strict';
  const specs = JSON.parse(document.getElementById('unigate-charts').textContent);

  function draw() {
    specs.forEach(function (spec) {
      const box = document.getElementById(spec.id);
      if (box) UnigateCharts[spec.kind](box, spec.options);
    });
  }

  let pending = null;
  window.addEventListener('resize', function () {
    clearTimeout(pending);
    pending = setTimeout(draw, 150);
  });
  draw();
})();
