/* Usage: tokens, requests and spend by day, model, key or team over a date range, as a chart and a table; CSV
 * export. A key's rows count under the team it is in now (a team's own record, on the Teams page, keeps what keys
 * spent in it before they left). */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  const DAY_MS = 86400000;
  const COLUMNS = ['date', 'key_id', 'key_name', 'model', 'requests', 'prompt_tokens', 'completion_tokens',
    'total_tokens', 'spend_usd', 'unpriced_requests', 'team_id', 'team_name'];
  const NO_TEAM = '(no team)';

  function isoDay(ms) { return new Date(ms).toISOString().slice(0, 10); }

  UG.usageCsv = function (rows) {
    const lines = rows.map((row) => COLUMNS.map((c) => UG.csvCell(row[c])).join(','));
    return [COLUMNS.join(',')].concat(lines).join('\r\n') + '\r\n';
  };

  function groupName(row, by) {
    if (by === 'key') return (row.key_name || row.key_id) + ' (' + row.key_id + ')';
    if (by === 'team') return row.team_id ? (row.team_name || row.team_id) + ' (' + row.team_id + ')' : NO_TEAM;
    return row[by === 'day' ? 'date' : 'model'];
  }

  function group(rows, by) {
    const groups = new Map();
    for (const row of rows) {
      const name = groupName(row, by);
      const g = groups.get(name) || { name: name, requests: 0, prompt_tokens: 0, completion_tokens: 0, total_tokens: 0,
        spend_usd: 0 };
      g.requests += row.requests;
      g.prompt_tokens += row.prompt_tokens;
      g.completion_tokens += row.completion_tokens;
      g.total_tokens += row.total_tokens;
      g.spend_usd += row.spend_usd;
      groups.set(name, g);
    }
    const list = Array.from(groups.values());
    if (by === 'day') list.sort((a, b) => a.name.localeCompare(b.name));
    else list.sort((a, b) => b.total_tokens - a.total_tokens);
    return list;
  }

  UG.pages.usage = {
    title: 'Usage',
    render(root) {
      const today = Date.now();
      const from = h('input', { type: 'date', id: 'usage-from', value: isoDay(today - 29 * DAY_MS) });
      const to = h('input', { type: 'date', id: 'usage-to', value: isoDay(today) });
      const by = h('select', { id: 'usage-by' }, [['day', 'Day'], ['model', 'Model'], ['key', 'Key'],
        ['team', 'Team']].map(
        ([v, t]) => h('option', { value: v }, t)));
      const metric = h('select', { id: 'usage-metric' }, [['total_tokens', 'Tokens'], ['requests', 'Requests'],
        ['spend_usd', 'Spend (USD)']].map(([v, t]) => h('option', { value: v }, t)));
      const summary = h('div', { class: 'grid', id: 'usage-summary' });
      const chart = h('div', { class: 'chart', id: 'usage-chart' });
      const table = h('div', { class: 'table-wrap' });
      const error = h('p', { class: 'error' });
      let rows = [];

      root.append(h('h1', {}, 'Usage'),
        h('div', { class: 'card' }, h('div', { class: 'row' },
          h('label', {}, 'From (UTC day)', from), h('label', {}, 'To', to), h('label', {}, 'Group by', by),
          h('label', {}, 'Chart', metric),
          h('button', { type: 'button', onclick: load }, 'Apply'),
          h('button', { type: 'button', class: 'secondary', id: 'usage-csv', onclick: download }, 'Download CSV')),
        error),
        summary, h('div', { class: 'card' }, chart), h('div', { class: 'card' }, table));
      by.addEventListener('change', draw);
      metric.addEventListener('change', draw);

      async function load() {
        error.textContent = '';
        const start = Date.parse(from.value + 'T00:00:00Z');
        const days = Math.min(400, Math.max(1, Math.floor((Date.now() - start) / DAY_MS) + 1));
        try {
          const result = await UG.api('GET', '/admin/usage/rows?days=' + days);
          rows = result.data.filter((r) => r.date >= from.value && r.date <= to.value);
        } catch (e) {
          error.textContent = e.message;
          rows = [];
        }
        draw();
      }

      function draw() {
        const groups = group(rows, by.value);
        const total = group(rows.map((r) => Object.assign({}, r, { model: 'all' })), 'model')[0] ||
          { requests: 0, total_tokens: 0, prompt_tokens: 0, completion_tokens: 0, spend_usd: 0 };
        UG.clear(summary).append(
          stat('Requests', UG.fmt(total.requests)), stat('Tokens', UG.fmt(total.total_tokens)),
          stat('Prompt / completion', UG.fmt(total.prompt_tokens) + ' / ' + UG.fmt(total.completion_tokens)),
          stat('Spend', '$' + UG.fmt(total.spend_usd, 6)));
        const key = metric.value;
        if (by.value === 'day') {
          const models = Array.from(new Set(rows.map((r) => r.model))).sort();
          const days = groups.map((g) => g.name);
          UnigateCharts.bars(chart, {
            categories: days, stacked: true, y: { label: metric.selectedOptions[0].textContent }, height: 240,
            series: models.map((model) => ({ name: model, values: days.map((d) => rows.filter(
              (r) => r.date === d && r.model === model).reduce((s, r) => s + r[key], 0)) })),
          });
        } else {
          UnigateCharts.bars(chart, {
            categories: groups.map((g) => g.name), y: { label: metric.selectedOptions[0].textContent }, height: 240,
            series: groups.length ? [{ name: metric.selectedOptions[0].textContent, values: groups.map((g) => g[key]) }] : [],
          });
        }
        const head = [by.selectedOptions[0].textContent, 'Requests', 'Prompt tokens', 'Completion tokens', 'Tokens',
          'Spend (USD)'];
        UG.clear(table).appendChild(h('table', { id: 'usage-table' },
          h('thead', {}, h('tr', {}, head.map((t, i) => h('th', { class: i ? 'num' : '' }, t)))),
          h('tbody', {}, groups.length ? groups.map((g) => h('tr', {}, h('td', {}, g.name),
            [g.requests, g.prompt_tokens, g.completion_tokens, g.total_tokens].map((v) => h('td', { class: 'num' },
              UG.fmt(v))), h('td', { class: 'num' }, UG.fmt(g.spend_usd, 6))))
            : h('tr', {}, h('td', { colspan: 6, class: 'muted' }, 'No usage in this range.')))));
      }

      function stat(label, value) {
        return h('div', { class: 'stat' }, h('div', { class: 'value' }, value), h('div', { class: 'label' }, label));
      }

      function download() {
        UG.download('unigate-usage-' + from.value + '-' + to.value + '.csv', UG.usageCsv(rows));
      }

      load();
    },
  };
})();
