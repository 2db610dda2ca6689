/*
 * unigate console: the shell (session, API calls, hash router) and the DOM helpers every page uses.
 * Pages register themselves in UG.pages; boot.js starts the app. Data is always inserted as text (never as markup),
 * and nothing is written to localStorage or sessionStorage: the CSRF token and a pasted API key live in memory only.
 */
(function () {
  'use strict';

  const UG = { pages: {}, csrf: null, current: null };
  window.UG = UG;

  /** h('td', {class: 'num', onclick: f}, 'text', childNode, ...) → element; strings become text nodes. */
  UG.h = function (tag, attrs) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else if (key === 'class') node.className = value;
      else if (key === 'value') node.value = value;
      else node.setAttribute(key, value === true ? '' : String(value));
    }
    for (let i = 2; i < arguments.length; i++) append(node, arguments[i]);
    return node;
  };

  function append(node, child) {
    if (child === undefined || child === null || child === false) return;
    if (Array.isArray(child)) child.forEach((c) => append(node, c));
    else node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }

  UG.clear = function (node) {
    while (node.firstChild) node.removeChild(node.firstChild);
    return node;
  };

  UG.fmt = function (value, digits) {
    if (value === null || value === undefined) return '—';
    if (typeof value !== 'number' || !isFinite(value)) return String(value);
    if (Number.isInteger(value)) return value.toLocaleString('en-US');
    return value.toLocaleString('en-US', { maximumFractionDigits: digits === undefined ? 2 : digits });
  };

  UG.bytes = function (n) {
    if (typeof n !== 'number') return '—';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return n.toFixed(i ? 1 : 0) + ' ' + units[i];
  };

  /** The page's parameters from the hash: `#/requests?key=key_…&status=429` → URLSearchParams. */
  UG.hashParams = function () {
    const hash = location.hash;
    const at = hash.indexOf('?');
    return new URLSearchParams(at < 0 ? '' : hash.slice(at + 1));
  };

  /** Rewrite the current page's hash parameters without routing again (no hashchange: the page stays as it is). */
  UG.replaceHashParams = function (params) {
    const query = params.toString();
    history.replaceState(null, '', '#/' + UG.current + (query ? '?' + query : ''));
  };

  /** One CSV cell, quoted as RFC 4180 does; a leading =, +, - or @ is prefixed so a spreadsheet never runs it. */
  UG.csvCell = function (value) {
    const text = value === null || value === undefined ? '' : String(value);
    const safe = /^[=+\-@]/.test(text) ? "'" + text : text;
    return /[",\n\r]/.test(safe) ? '"' + safe.replace(/"/g, '""') + '"' : safe;
  };

  /** Save `text` as a file (made in the browser: nothing is sent anywhere). */
  UG.download = function (name, text, type) {
    const url = URL.createObjectURL(new Blob([text], { type: type || 'text/csv' }));
    const link = UG.h('a', { href: url, download: name });
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  };

  UG.pct = function (x) {
    return typeof x === 'number' && isFinite(x) ? (100 * x).toFixed(1) + ' %' : '—';
  };

  /** An API error: the gateway's envelope (message, code) and the HTTP status. */
  class ApiError extends Error {
    constructor(status, error) {
      super((error && error.message) || 'HTTP ' + status);
      this.status = status;
      this.code = (error && error.code) || 'http_' + status;
    }
  }
  UG.ApiError = ApiError;

  UG.errorOf = async function (response) {
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    const error = body && (body.error || body);
    return new ApiError(response.status, error && typeof error === 'object' ? error : null);
  };

  /** Call the admin API (or /ui/api) with the session cookie, and the CSRF token on state-changing calls. */
  UG.api = async function (method, path, body) {
    const headers = { accept: 'application/json' };
    if (body !== undefined) headers['content-type'] = 'application/json';
    if (method !== 'GET' && UG.csrf) headers['x-csrf-token'] = UG.csrf;
    const response = await fetch(path, {
      method: method, headers: headers, credentials: 'same-origin', cache: 'no-store',
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!response.ok) {
      const error = await UG.errorOf(response);
      if (response.status === 401 && path.startsWith('/admin/')) UG.showLogin('Your session has ended: log in again.');
      throw error;
    }
    return response.json();
  };

  /** A repeating task for the current page, stopped when the page is left. */
  UG.every = function (ms, task) {
    let timer = null;
    let stopped = false;
    async function tick() {
      try { await task(); } catch (e) { /* shown by the task itself */ }
      if (!stopped) timer = setTimeout(tick, ms);
    }
    tick();
    const stop = () => { stopped = true; clearTimeout(timer); };
    UG.onLeave(stop);
    return stop;
  };

  let leaveHandlers = [];
  UG.onLeave = function (handler) { leaveHandlers.push(handler); };

  UG.copy = async function (text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (e) { // no clipboard API (plain http on another host): copy through a selected textarea
      const area = UG.h('textarea', { class: 'offscreen' }, text);
      document.body.appendChild(area);
      area.select();
      document.execCommand('copy');
      area.remove();
    }
    if (button) {
      const label = button.textContent;
      button.textContent = 'Copied';
      setTimeout(() => { button.textContent = label; }, 1500);
    }
  };

  /** A confirmation dialog in the page; resolves true when confirmed. */
  UG.confirm = function (message, action) {
    const modal = document.getElementById('modal');
    return new Promise((resolve) => {
      const close = (answer) => { modal.hidden = true; UG.clear(modal); resolve(answer); };
      UG.clear(modal).appendChild(UG.h('div', { class: 'card', role: 'dialog', 'aria-modal': 'true' },
        UG.h('p', {}, message),
        UG.h('div', { class: 'row' },
          UG.h('button', { type: 'button', class: 'danger', id: 'confirm-yes', onclick: () => close(true) }, action),
          UG.h('button', { type: 'button', class: 'secondary', onclick: () => close(false) }, 'Cancel'))));
      modal.hidden = false;
    });
  };

  UG.showLogin = function (message) {
    UG.csrf = null;
    leave();
    document.getElementById('nav').hidden = true;
    document.getElementById('logout').hidden = true;
    document.getElementById('page').hidden = true;
    document.getElementById('login').hidden = false;
    document.getElementById('login-error').textContent = message || '';
    document.getElementById('login-key').focus();
  };

  function leave() {
    const handlers = leaveHandlers;
    leaveHandlers = [];
    handlers.forEach((handler) => handler());
  }

  UG.route = function () {
    if (!UG.csrf) return;
    const name = (location.hash.replace(/^#\/?/, '').split('?')[0]) || 'keys';
    const page = UG.pages[name] || UG.pages.keys;
    leave();
    UG.current = name;
    for (const link of document.querySelectorAll('#nav a')) link.classList.toggle('active', link.dataset.page === name);
    const root = UG.clear(document.getElementById('page'));
    root.hidden = false;
    document.getElementById('login').hidden = true;
    document.getElementById('nav').hidden = false;
    document.getElementById('logout').hidden = false;
    document.title = page.title + ' · unigate console';
    page.render(root);
  };

  UG.start = async function () {
    window.addEventListener('hashchange', UG.route);
    document.getElementById('login-form').addEventListener('submit', async (event) => {
      event.preventDefault();
      const input = document.getElementById('login-key');
      try {
        const session = await UG.api('POST', '/ui/api/login', { master_key: input.value });
        input.value = '';
        UG.csrf = session.csrf_token;
        UG.route();
      } catch (error) {
        document.getElementById('login-error').textContent = error.message;
      }
    });
    document.getElementById('logout').addEventListener('click', async () => {
      try { await UG.api('POST', '/ui/api/logout', {}); } finally { UG.showLogin('Logged out.'); }
    });
    try {
      const session = await UG.api('GET', '/ui/api/session');
      UG.csrf = session.csrf_token;
      UG.route();
    } catch (error) {
      UG.showLogin('');
    }
  };
})();
