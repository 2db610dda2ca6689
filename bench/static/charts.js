/*
 * unigate charts: small SVG line, bar and sparkline charts shared by the bench HTML reports and the web console.
 *
 * Vanilla ES2017, no dependencies, no eval, no network. Everything is drawn with SVG presentation attributes
 * (fill, stroke, font-size ...), never inline styles, so it runs under a strict `style-src 'self'` CSP; text is
 * always set through text nodes, never parsed as markup. Callers style it further with the classes below:
 *   svg.uc-chart (+ .uc-line | .uc-bars | .uc-sparkline), .uc-axis, .uc-grid, .uc-legend, .uc-series,
 *   .uc-point, .uc-bar, .uc-hline, .uc-vline, .uc-empty.
 *
 * API (each call replaces the container's content and returns the <svg> element):
 *   UnigateCharts.line(container, {series: [{name, points: [[x, y], ...]}], x: {label, log: false},
 *                                  y: {label, min?}, hlines: [{y, label}], vlines: [{x, label}], height: 240})
 *   UnigateCharts.bars(container, {categories: [...], series: [{name, values: [...]}], stacked: false,
 *                                  y: {label}, height: 240})
 *   UnigateCharts.sparkline(container, values, {width: 120, height: 24})
 * Optional extras: `width` (default: the container's width, else 640), `title` (the svg's aria-label), per series
 * `color` and `dash: true`, per hline/vline `color`, `x.ticks` (explicit tick values). A y of null leaves a gap.
 */
(function (root) {
  'use strict';

  const NS = 'http://www.w3.org/2000/svg';
  const PALETTE = ['#4e79a7', '#f28e2b', '#e15759', '#59a14f', '#b07aa1', '#76b7b2', '#edc948', '#9c755f'];
  const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';
  const TEXT = '#333';
  const MUTED = '#777';
  const GRID = '#e5e5e5';
  const MARKER = '#c0392b';

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const key of Object.keys(attrs || {})) {
      if (attrs[key] !== undefined && attrs[key] !== null) node.setAttribute(key, String(attrs[key]));
    }
    if (parent) parent.appendChild(node);
    return node;
  }

  function text(parent, x, y, content, attrs) {
    const node = el('text', Object.assign({ x: x, y: y, fill: TEXT }, attrs || {}), parent);
    node.appendChild(document.createTextNode(String(content)));
    return node;
  }

  function title(parent, content) {
    el('title', {}, parent).appendChild(document.createTextNode(content));
  }

  function isNum(v) {
    return typeof v === 'number' && isFinite(v);
  }

  function color(series, index) {
    return series.color || PALETTE[index % PALETTE.length];
  }

  /** A value for people: at most 4 significant digits, k/M suffixes from 10,000 up. */
  function fmt(v) {
    if (!isNum(v)) return '-';
    const a = Math.abs(v);
    if (a >= 1e9) return trim((v / 1e9).toPrecision(3)) + 'G';
    if (a >= 1e6) return trim((v / 1e6).toPrecision(3)) + 'M';
    if (a >= 1e4) return trim((v / 1e3).toPrecision(3)) + 'k';
    if (a >= 100) return String(Math.round(v));
    if (a === 0) return '0';
    return trim(v.toPrecision(3));
  }

  function trim(s) {
    return s.indexOf('e') >= 0 || s.indexOf('.') < 0 ? s : s.replace(/0+$/, '').replace(/\.$/, '');
  }

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  }

  /** A linear domain widened to whole tick steps, and its ticks. */
  function linearScale(min, max, count) {
    if (!(max > min)) {
      const pad = min === 0 ? 1 : Math.abs(min) * 0.1;
      min -= min === 0 ? 0 : pad;
      max += pad;
    }
    const step = niceStep(max - min, count);
    const lo = Math.floor(min / step + 1e-9) * step;
    const hi = Math.ceil(max / step - 1e-9) * step;
    const ticks = [];
    for (let v = lo; v <= hi + step * 1e-6; v += step) ticks.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return { min: lo, max: hi, ticks: ticks.map(function (t) { return +t.toPrecision(12); }) };
  }

  /** Log domain over positive values; ticks at the data's own x values when few, else powers of ten. */
  function logScale(values, explicit) {
    const pos = values.filter(function (v) { return v > 0; });
    let min = pos.length ? Math.min.apply(null, pos) : 1;
    let max = pos.length ? Math.max.apply(null, pos) : 10;
    if (max === min) { min /= 2; max *= 2; }
    let ticks = explicit;
    if (!ticks) {
      const distinct = Array.from(new Set(pos)).sort(function (a, b) { return a - b; });
      if (distinct.length >= 2 && distinct.length <= 12) ticks = distinct;
      else {
        ticks = [];
        for (let p = Math.floor(Math.log10(min)); p <= Math.ceil(Math.log10(max)); p++) ticks.push(Math.pow(10, p));
      }
    }
    return { min: min, max: max, ticks: ticks.filter(function (t) { return t >= min && t <= max; }), log: true };
  }

  function project(scale, v, from, to) {
    if (scale.log) {
      const a = Math.log(scale.min), b = Math.log(scale.max);
      return from + ((Math.log(v) - a) / (b - a)) * (to - from);
    }
    return from + ((v - scale.min) / (scale.max - scale.min)) * (to - from);
  }

  function start(container, cls, width, height, label) {
    while (container.firstChild) container.removeChild(container.firstChild);
    const svg = el('svg', {
      class: 'uc-chart ' + cls, width: width, height: height, viewBox: '0 0 ' + width + ' ' + height,
      role: 'img', 'aria-label': label || null, 'font-family': FONT, 'font-size': 11,
    });
    container.appendChild(svg);
    return svg;
  }

  function widthOf(container, opts, fallback) {
    const w = (opts && opts.width) || container.clientWidth || fallback;
    return Math.max(160, Math.round(w));
  }

  function empty(svg, width, height) {
    text(svg, width / 2, height / 2, 'no data', { class: 'uc-empty', 'text-anchor': 'middle', fill: MUTED });
    return svg;
  }

  /** Legend items laid out in rows; returns the height it takes. */
  function legend(svg, items, left, right, top) {
    const group = el('g', { class: 'uc-legend' }, svg);
    let x = left, y = top, rows = 1;
    items.forEach(function (item) {
      const w = 22 + Math.min(40, String(item.name).length) * 6.2 + 14;
      if (x + w > right && x > left) { x = left; y += 16; rows++; }
      el('line', {
        x1: x, x2: x + 16, y1: y - 4, y2: y - 4, stroke: item.color, 'stroke-width': item.bar ? 8 : 2,
        'stroke-dasharray': item.dash ? '4 3' : null,
      }, group);
      text(group, x + 21, y, item.name);
      x += w;
    });
    return rows * 16 + 4;
  }

  function yAxis(svg, scale, box, label, format) {
    const axis = el('g', { class: 'uc-axis uc-axis-y' }, svg);
    scale.ticks.forEach(function (t) {
      const y = project(scale, t, box.bottom, box.top);
      el('line', { class: 'uc-grid', x1: box.left, x2: box.right, y1: y, y2: y, stroke: GRID }, axis);
      text(axis, box.left - 6, y + 4, format(t), { 'text-anchor': 'end', fill: MUTED });
    });
    el('line', { x1: box.left, x2: box.left, y1: box.top, y2: box.bottom, stroke: MUTED }, axis);
    if (label) {
      const cy = (box.top + box.bottom) / 2;
      text(axis, 14, cy, label, { 'text-anchor': 'middle', transform: 'rotate(-90 14 ' + cy + ')' });
    }
  }

  function line(container, opts) {
    opts = opts || {};
    const height = opts.height || 240;
    const width = widthOf(container, opts, 640);
    const xo = opts.x || {}, yo = opts.y || {};
    const isLog = !!xo.log;
    const hasX = function (x) { return isNum(x) && (!isLog || x > 0); };  // a log axis has no place for x <= 0
    const svg = start(container, 'uc-line', width, height, opts.title || yo.label);
    const series = (opts.series || []).filter(function (s) {
      return (s.points || []).some(function (p) { return hasX(p[0]) && isNum(p[1]); });
    });
    if (!series.length) return empty(svg, width, height);
    const hlines = (opts.hlines || []).filter(function (h) { return isNum(h.y); });
    const vlines = (opts.vlines || []).filter(function (v) { return hasX(v.x); });

    const xs = [], ys = [];
    series.forEach(function (s) {
      s.points.forEach(function (p) {
        if (hasX(p[0])) xs.push(p[0]);
        if (hasX(p[0]) && isNum(p[1])) ys.push(p[1]);
      });
    });
    vlines.forEach(function (v) { xs.push(v.x); });
    hlines.forEach(function (h) { ys.push(h.y); });
    let xScale;
    if (isLog) xScale = logScale(xs, xo.ticks);
    else {
      xScale = linearScale(Math.min.apply(null, xs), Math.max.apply(null, xs), Math.max(2, Math.floor(width / 90)));
      if (xo.ticks) xScale.ticks = xo.ticks;
    }
    const yMin = isNum(yo.min) ? yo.min : Math.min(0, Math.min.apply(null, ys));
    const yScale = linearScale(yMin, Math.max(yMin, Math.max.apply(null, ys)), Math.max(2, Math.floor(height / 50)));

    const top = 10 + legend(svg, series.map(function (s, i) {
      return { name: s.name, color: color(s, i), dash: s.dash };
    }), 56, width - 12, 14);
    const box = { left: 56, right: width - 16, top: top, bottom: height - (xo.label ? 38 : 24) };
    yAxis(svg, yScale, box, yo.label, fmt);

    const xAxis = el('g', { class: 'uc-axis uc-axis-x' }, svg);
    el('line', { x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom, stroke: MUTED }, xAxis);
    xScale.ticks.forEach(function (t) {
      const x = project(xScale, t, box.left, box.right);
      el('line', { x1: x, x2: x, y1: box.bottom, y2: box.bottom + 4, stroke: MUTED }, xAxis);
      text(xAxis, x, box.bottom + 15, fmt(t), { 'text-anchor': 'middle', fill: MUTED });
    });
    if (xo.label) text(xAxis, (box.left + box.right) / 2, height - 6, xo.label, { 'text-anchor': 'middle' });

    hlines.forEach(function (h) {
      const y = project(yScale, h.y, box.bottom, box.top);
      const g = el('g', { class: 'uc-hline' }, svg);
      el('line', {
        x1: box.left, x2: box.right, y1: y, y2: y, stroke: h.color || MARKER, 'stroke-dasharray': '6 4',
      }, g);
      if (h.label) text(g, box.right - 4, y - 4, h.label, { 'text-anchor': 'end', fill: h.color || MARKER });
      title(g, (h.label || '') + ' ' + fmt(h.y));
    });
    vlines.forEach(function (v, i) {
      const x = project(xScale, v.x, box.left, box.right);
      const g = el('g', { class: 'uc-vline' }, svg);
      el('line', {
        x1: x, x2: x, y1: box.top, y2: box.bottom, stroke: v.color || MUTED, 'stroke-dasharray': '3 3',
      }, g);
      const anchor = x > (box.left + box.right) / 2 ? 'end' : 'start';
      if (v.label) {
        text(g, x + (anchor === 'end' ? -4 : 4), box.top + 12 + 13 * i, v.label, {
          'text-anchor': anchor, fill: v.color || MUTED,
        });
      }
      title(g, (v.label || '') + ' ' + fmt(v.x));
    });

    series.forEach(function (s, i) {
      const c = color(s, i);
      const g = el('g', { class: 'uc-series uc-series-' + i }, svg);
      let d = '', pen = 'M';
      const pts = s.points.filter(function (p) { return hasX(p[0]); }).sort(function (a, b) {
        return a[0] - b[0];
      });
      pts.forEach(function (p) {
        if (!isNum(p[1])) { pen = 'M'; return; }
        const x = project(xScale, p[0], box.left, box.right), y = project(yScale, p[1], box.bottom, box.top);
        d += pen + x.toFixed(1) + ' ' + y.toFixed(1) + ' ';
        pen = 'L';
      });
      el('path', {
        d: d.trim(), fill: 'none', stroke: c, 'stroke-width': 2, 'stroke-dasharray': s.dash ? '5 4' : null,
        'stroke-linejoin': 'round',
      }, g);
      pts.forEach(function (p) {
        if (!isNum(p[1])) return;
        const dot = el('circle', {
          class: 'uc-point', cx: project(xScale, p[0], box.left, box.right).toFixed(1),
          cy: project(yScale, p[1], box.bottom, box.top).toFixed(1), r: 3, fill: c,
        }, g);
        title(dot, s.name + ': ' + (xo.label || 'x') + ' ' + fmt(p[0]) + ', ' + (yo.label || 'y') + ' ' + fmt(p[1]));
      });
    });
    return svg;
  }

  function bars(container, opts) {
    opts = opts || {};
    const height = opts.height || 240;
    const width = widthOf(container, opts, 640);
    const yo = opts.y || {};
    const svg = start(container, 'uc-bars', width, height, opts.title || yo.label);
    const categories = opts.categories || [];
    const series = (opts.series || []).filter(function (s) { return (s.values || []).some(isNum); });
    if (!series.length || !categories.length) return empty(svg, width, height);
    const stacked = !!opts.stacked;
    let max = 0;
    categories.forEach(function (_, ci) {
      let sum = 0;
      series.forEach(function (s) {
        const v = isNum(s.values[ci]) ? Math.max(0, s.values[ci]) : 0;
        sum = stacked ? sum + v : Math.max(sum, v);
      });
      max = Math.max(max, sum);
    });
    const yScale = linearScale(0, max, Math.max(2, Math.floor(height / 50)));
    const top = 10 + legend(svg, series.map(function (s, i) {
      return { name: s.name, color: color(s, i), bar: true };
    }), 56, width - 12, 14);
    const box = { left: 56, right: width - 12, top: top, bottom: height - 24 };
    yAxis(svg, yScale, box, yo.label, fmt);

    const band = (box.right - box.left) / categories.length;
    const inner = band * 0.8;
    const barWidth = stacked ? inner : inner / series.length;
    const labelEvery = Math.max(1, Math.ceil((categories.length * 60) / (box.right - box.left)));
    const xAxis = el('g', { class: 'uc-axis uc-axis-x' }, svg);
    el('line', { x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom, stroke: MUTED }, xAxis);
    categories.forEach(function (cat, ci) {
      const x0 = box.left + band * ci + (band - inner) / 2;
      if (ci % labelEvery === 0) {
        text(xAxis, box.left + band * (ci + 0.5), box.bottom + 15, cat, { 'text-anchor': 'middle', fill: MUTED });
      }
      let base = 0;
      series.forEach(function (s, si) {
        const v = s.values[ci];
        if (!isNum(v)) return;
        const lo = stacked ? base : 0, hi = lo + Math.max(0, v);
        const yTop = project(yScale, hi, box.bottom, box.top), yBottom = project(yScale, lo, box.bottom, box.top);
        const rect = el('rect', {
          class: 'uc-bar uc-series-' + si, x: (stacked ? x0 : x0 + barWidth * si).toFixed(1), y: yTop.toFixed(1),
          width: Math.max(1, barWidth - (stacked ? 0 : 1)).toFixed(1), height: Math.max(0, yBottom - yTop).toFixed(1),
          fill: color(s, si),
        }, svg);
        title(rect, s.name + ' · ' + cat + ': ' + fmt(v));
        if (stacked) base = hi;
      });
    });
    return svg;
  }

  function sparkline(container, values, opts) {
    opts = opts || {};
    const width = opts.width || 120, height = opts.height || 24;
    const svg = start(container, 'uc-sparkline', width, height, opts.title);
    const nums = (values || []).filter(isNum);
    if (!nums.length) {
      text(svg, width / 2, height / 2 + 4, 'no data', {
        class: 'uc-empty', 'text-anchor': 'middle', fill: MUTED, 'font-size': 10,
      });
      return svg;
    }
    const lo = Math.min.apply(null, nums), hi = Math.max.apply(null, nums);
    const span = hi - lo || 1, n = values.length;
    let d = '', pen = 'M', last = null;
    values.forEach(function (v, i) {
      if (!isNum(v)) { pen = 'M'; return; }
      const x = n === 1 ? width / 2 : 1 + (i / (n - 1)) * (width - 2);
      const y = height - 2 - ((v - lo) / span) * (height - 4);
      d += pen + x.toFixed(1) + ' ' + y.toFixed(1) + ' ';
      pen = 'L';
      last = [x, y];
    });
    el('path', { d: d.trim(), fill: 'none', stroke: opts.color || PALETTE[0], 'stroke-width': 1.5 }, svg);
    el('circle', { cx: last[0].toFixed(1), cy: last[1].toFixed(1), r: 2, fill: opts.color || PALETTE[0] }, svg);
    title(svg, 'min ' + fmt(lo) + ', max ' + fmt(hi) + ', last ' + fmt(nums[nums.length - 1]));
    return svg;
  }

  const api = { line: line, bars: bars, sparkline: sparkline, palette: PALETTE.slice(), format: fmt };
  root.UnigateCharts = api;
  if (typeof module === 'object' && module && module.exports) module.exports = api;
})(typeof window !== 'undefined' ? window : globalThis);
