/* Models: the routing table with each deployment's host, state (with a failed load's reason, and the models of a
 * wildcard deployment that cool down on their own), cooldown, in-flight requests, and its recent latency and error
 * rate (differences between reads of GET /admin/models over the last minute; this instance's view). Each model and
 * deployment links to the Requests page filtered by it. */
(function () {
  'use strict';
  const UG = window.UG;
  const h = UG.h;
  const POLL_MS = 2000;
  const WINDOW_MS = 60000;

  UG.pages.models = {
    title: 'Models',
    render(root) {
      const box = h('div', { id: 'models' });
      const error = h('p', { class: 'error' });
      const history = []; // [{at, counters: {deployment: {num_attempts, num_errors, latency_sum_s}}}]
      root.append(h('h1', {}, 'Models'),
        h('p', { class: 'muted' }, 'Routing table as this gateway instance sees it; refreshed every 2 s. Latency and ' +
          'error rate cover the attempts of the last minute (since start before the page has a minute of history).'),
        error, box);

      UG.every(POLL_MS, async () => {
        let result;
        try {
          result = await UG.api('GET', '/admin/models');
          error.textContent = '';
        } catch (e) { error.textContent = e.message; return; }
        const now = Date.now();
        const counters = {};
        for (const model of result.data) for (const d of model.deployments) counters[d.name] = d;
        history.push({ at: now, counters: counters });
        while (history.length > 2 && now - history[1].at >= WINDOW_MS) history.shift();
        draw(result.data, history[0].at < now - POLL_MS / 2 ? history[0].counters : {});
      });

      function recent(d, before) {
        const old = before[d.name] || { num_attempts: 0, num_errors: 0, latency_sum_s: 0 };
        const attempts = d.num_attempts - old.num_attempts;
        if (attempts <= 0) return { latency: null, errors: null, attempts: 0 };
        return { attempts: attempts, latency: (d.latency_sum_s - old.latency_sum_s) / attempts,
          errors: (d.num_errors - old.num_errors) / attempts };
      }

      // The badge (a failed load styled as down), then what explains it: until when it cools down, why it failed
      // to load (the error code its requests get), and a wildcard deployment's models that cool down on their own.
      function stateCell(d) {
        const style = d.state === 'load_failed' ? 'down' : d.state;
        const cell = h('td', {}, h('span', { class: 'badge ' + style, 'data-state': d.state }, d.state.replace('_', ' ')));
        if (d.state === 'cooling_down' && d.cooldown_until) {
          cell.appendChild(h('div', { class: 'muted' }, 'until ' + new Date(d.cooldown_until).toLocaleTimeString() +
            ' (' + Math.ceil(d.cooldown_remaining_s) + ' s)'));
        }
        if (d.state_reason) {
          cell.appendChild(h('div', { class: 'muted', 'data-reason': d.state_reason },
            d.state_reason + ' (the gateway log says why)'));
        }
        const cooling = d.cooling_models || [];
        if (d.num_cooling_models) {
          const names = cooling.map((m) => m.model + ' (' + Math.ceil(m.cooldown_remaining_s) + ' s)').join(', ');
          const more = d.num_cooling_models > cooling.length ? ', …' : '';
          cell.appendChild(h('div', { class: 'muted', 'data-cooling-models': String(d.num_cooling_models) },
            '· ' + d.num_cooling_models + (d.num_cooling_models === 1 ? ' model' : ' models') + ' cooling: ' +
            names + more));
        }
        return cell;
      }

      function requestsLink(filter, value) {
        return '#/requests?' + filter + '=' + encodeURIComponent(value);
      }

      function draw(models, before) {
        UG.clear(box);
        if (!models.length) box.appendChild(h('p', { class: 'muted' }, 'No models are routed.'));
        for (const model of models) {
          const rows = model.deployments.map((d) => {
            const r = recent(d, before);
            return h('tr', { 'data-deployment': d.name },
              h('td', {}, h('a', { href: requestsLink('deployment', d.name), 'data-requests': 'deployment',
                title: 'Requests this deployment answered' }, d.name)), h('td', {}, d.type), h('td', {}, d.host || (d.type === 'local' ? 'in-process' : '—')),
              stateCell(d),
              h('td', { class: 'num' }, d.num_in_flight + ' / ' + (d.max_in_flight === null ? '∞' : d.max_in_flight)),
              h('td', { class: 'num' }, r.latency === null ? '—' : (1000 * r.latency).toFixed(0) + ' ms'),
              h('td', { class: 'num' }, r.errors === null ? '—' : UG.pct(r.errors) + ' of ' + r.attempts),
              h('td', { class: 'num hide-narrow' }, UG.fmt(d.weight)));
          });
          box.appendChild(h('div', { class: 'card', 'data-model': model.id },
            h('div', { class: 'row' }, h('h2', { class: 'grow' }, model.id),
              h('a', { href: requestsLink('model', model.id), class: 'link', 'data-requests': 'model',
                title: 'Requests that asked for ' + model.id + ' by this name' }, 'Requests')),
            h('p', { class: 'muted' }, 'Aliases: ' + (model.aliases.join(', ') || 'none') +
              (model.fallbacks.length ? ' · fallbacks: ' + model.fallbacks.join(' → ') : '')),
            h('div', { class: 'table-wrap' }, h('table', {},
              h('thead', {}, h('tr', {}, ['Deployment', 'Type', 'Upstream host', 'State', 'In flight / max',
                'Latency', 'Errors', 'Weight'].map((t, i) => h('th', { class: (i >= 4 ? 'num' : '') +
                (i === 7 ? ' hide-narrow' : '') }, t)))),
              h('tbody', {}, rows)))));
        }
      }
    },
  };
})();
