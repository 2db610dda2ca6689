/* Runs last (every script is `defer`, so in order, once the page is parsed): start the console. */
window.UG.start();
